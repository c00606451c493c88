/* A wall-clock offset for one process (redis-server in the leasing tests), steerable while it runs.

   Why not libfaketime: it hangs Debian's redis-server 7.0 at start (clock_gettime recursing through
   jemalloc's initialisation). This shim allocates nothing and resolves nothing: it reads the clocks
   with the raw system call and adds an offset to the wall clock only (CLOCK_REALTIME and its coarse
   variant, gettimeofday, time), so the monotonic clock that Redis's timers use never moves.

   The offset is read from a file named by $CLOCK_SHIM_FILE, mapped into memory at start: two
   little-endian int64s, the offset in microseconds and its bitwise complement. A test rewrites them in
   place (one pwrite; see tests/redis_servers.py); a reader that sees a half-written pair (the two do
   not match) reads again, so a step is never seen torn. Built by the tests with the system C
   compiler: gcc -shared -fPIC -O2 -o clock_shim.so clock_shim.c */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static const volatile int64_t *offset_pair;
static int64_t last_good;

static int64_t offset_us(void) {
    if (offset_pair == NULL) return 0;
    for (int tries = 0; tries < 1000; tries++) {
        int64_t value = offset_pair[0], check = offset_pair[1];
        if (value == ~check) {
            last_good = value;
            return value;
        }
    }
    return last_good;
}

__attribute__((constructor)) static void clock_shim_init(void) {
    const char *path = getenv("CLOCK_SHIM_FILE");
    if (path == NULL) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    void *map = mmap(NULL, 2 * sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map != MAP_FAILED) offset_pair = map;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long rc = syscall(SYS_clock_gettime, id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        int64_t ns = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec + offset_us() * 1000;
        ts->tv_sec = ns / 1000000000;
        ts->tv_nsec = ns % 1000000000;
    }
    return (int)rc;
}

/* Declared without <sys/time.h> so that glibc's prototype (which varies between versions) cannot
   conflict; the layout is the kernel's struct timeval. */
struct shim_timeval {
    long tv_sec;
    long tv_usec;
};

int gettimeofday(struct shim_timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL) *out = ts.tv_sec;
    return ts.tv_sec;
}
