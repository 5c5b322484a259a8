/* A stand-in for busybox's `nmeter`, for the node e2e images built offline.
 *
 * Debian's busybox has no nmeter applet, and the node e2e suite's lifecycle specs
 * stamp each line a container writes with `date -u +%FT$(nmeter -d0 '%3t' | head -n1)Z`.
 * This program knows only what that needs: `nmeter [-d MSEC] FORMAT`, where FORMAT may hold
 * `%t` (the time of day, HH:MM:SS, UTC) or `%Nt` (with N digits of the second's fraction);
 * any other character is printed as it is. It prints a line every MSEC milliseconds (0: at
 * once, again and again) until its output is closed, as nmeter does.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void put_time(int digits) {
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    printf("%02d:%02d:%02d", tm.tm_hour, tm.tm_min, tm.tm_sec);
    if (digits > 0) {
        long frac = now.tv_nsec;
        int d;
        for (d = 9; d > digits; d--)
            frac /= 10;
        printf(".%0*ld", digits, frac);
    }
}

static void put_line(const char *fmt) {
    const char *p;
    for (p = fmt; *p; p++) {
        if (p[0] == '%' && p[1] >= '1' && p[1] <= '9' && p[2] == 't') {
            put_time(p[1] - '0');
            p += 2;
        } else if (p[0] == '%' && p[1] == 't') {
            put_time(0);
            p += 1;
        } else {
            putchar(*p);
        }
    }
    putchar('\n');
}

int main(int argc, char **argv) {
    long delay_ms = 1000;
    int opt;
    while ((opt = getopt(argc, argv, "d:")) != -1) {
        if (opt != 'd') {
            fprintf(stderr, "usage: nmeter [-d MSEC] FORMAT\n");
            return 1;
        }
        delay_ms = strtol(optarg, NULL, 10);
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: nmeter [-d MSEC] FORMAT\n");
        return 1;
    }
    signal(SIGPIPE, SIG_DFL);
    for (;;) {
        put_line(argv[optind]);
        if (fflush(stdout) != 0 || ferror(stdout))
            return 0;
        if (delay_ms > 0)
            usleep((useconds_t)delay_ms * 1000);
    }
}
