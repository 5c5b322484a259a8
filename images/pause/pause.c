/*
 * pause: the infrastructure process of a cri-shim pod sandbox.
 *
 * It holds the pod's namespaces open and does nothing else. When it is PID 1
 * of a shared PID namespace it must reap orphans, or they stay zombies.
 * SIGTERM and SIGINT end it with status 0, so a graceful stop is quick.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

static void handle_stop(int signo) {
    (void)signo;
    stopping = 1;
}

static void reap(int signo) {
    int saved_errno = errno;
    (void)signo;
    for (;;) {
        pid_t pid = waitpid(-1, NULL, WNOHANG);
        if (pid <= 0)
            break;
    }
    errno = saved_errno;
}

static int install(int signo, void (*fn)(int), int flags) {
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_handler = fn;
    act.sa_flags = flags;
    sigemptyset(&act.sa_mask);
    return sigaction(signo, &act, NULL);
}

int main(int argc, char *argv[]) {
    if (argc == 2 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
        puts("pause (cri-shim) 3.10");
        return 0;
    }
    if (install(SIGTERM, handle_stop, 0) != 0 || install(SIGINT, handle_stop, 0) != 0 ||
        install(SIGCHLD, reap, SA_NOCLDSTOP | SA_RESTART) != 0) {
        perror("pause: sigaction");
        return 1;
    }
    /* Keep the stop signals blocked except inside sigsuspend, so one that
     * arrives between the check and the wait cannot be lost. */
    sigset_t stop_set, wait_set;
    sigemptyset(&stop_set);
    sigaddset(&stop_set, SIGTERM);
    sigaddset(&stop_set, SIGINT);
    sigprocmask(SIG_BLOCK, &stop_set, &wait_set);
    sigdelset(&wait_set, SIGTERM);
    sigdelset(&wait_set, SIGINT);
    while (!stopping)
        sigsuspend(&wait_set);
    return 0;
}
