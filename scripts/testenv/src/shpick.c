/*
 * /bin/sh of the stand-in busybox:1.37.0-1 image (scripts/testenv/node-e2e-images).
 *
 * Upstream busybox's ash passes every variable of its environment on to the
 * commands it runs, names that are not shell names (`data-1`, `1-x`, `$_-x`)
 * included; Debian's busybox 1.35, which the stand-in is made of, drops those
 * when it starts. Kubernetes' ConfigMap and Secret specs read such names back
 * with `sh -c env`, and other specs compare ash's own error messages
 * ("/bin/sh: can't create /file: Read-only file system"). No one shell here
 * does both, so this picks: busybox ash when every name in the environment is
 * a shell name (ash then loses nothing), Debian's static bash, which keeps
 * them all, otherwise. Either runs with the arguments given.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

#define ASH "/bin/busybox"
#define BASH "/bin/bash-static"

static int shell_name(const char *entry)
{
    const char *p = entry;

    if (!((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || *p == '_'))
        return 0;
    for (p++; *p && *p != '='; p++)
        if (!((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_'))
            return 0;
    return 1;
}

int main(int argc, char **argv)
{
    const char *shell = ASH;
    char **e;

    (void)argc;
    for (e = environ; *e; e++) {
        if (strchr(*e, '=') && !shell_name(*e)) {
            shell = BASH;
            break;
        }
    }
    /* argv[0] stays: busybox picks its applet by its base name (sh), bash its POSIX mode, and both
     * begin their messages with it ("/bin/sh: ..."). */
    execv(shell, argv);
    perror(shell);
    return 127;
}
