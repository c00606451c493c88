/*
 * A small memcached load generator for bench/server_bench.py, text or binary protocol.
 *
 * Why C: a Python client would limit the figures long before memcached does. One thread drives every
 * connection with epoll; each connection keeps --depth GET requests of --keys keys in flight, and
 * every response is checked byte by byte (VALUE <key> 0 <len>, digits, END). With --binary a request
 * is one binary GET (--keys 1) or a quiet multi-get, GETKQ per key then NOOP (--keys N); every packet
 * is checked (magic, opcode, status 0, the request's opaque echoed, four flag bytes, the key echoed
 * by GETKQ, digits). For ID servers,
 * --increasing checks that every connection sees strictly increasing values (O(1) per value, so it
 * costs the timed run nothing), and --unique collects every value and checks for duplicates at the
 * end (that costs memory traffic on the client, so use it in a verification run, not a timed one).
 *
 * Output: one JSON object on stdout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define RBUF (1 << 20)
#define HIST_US 1000000 /* latency histogram: 1 us buckets up to 1 s */

typedef struct {
    int fd;
    char *rbuf;
    size_t rlen;
    int inflight;
    double *sent_at; /* ring of send times, one per in-flight request */
    int head, tail;
    uint64_t last_value;
    uint32_t next_opaque, expect_opaque; /* binary: each request carries its own opaque */
} conn_t;

static char *host = "127.0.0.1", *unix_path = NULL;
static int port = 11212, nconns = 1, depth = 1, nkeys = 1, unique = 0, increasing = 0, binary = 0;
static double seconds = 2.0;
static char request[1 << 16];
static size_t request_len;
static char keys[1024][16];
static size_t keylens[1024];
static size_t opaque_at[1025]; /* binary: offsets of the opaque fields in the request */
static int npackets;           /* binary: packets per request (and per response) */
static uint64_t *values;
static size_t nvalues, capvalues;
static uint64_t *hist;
static uint64_t responses, errors_seen, not_increasing;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    printf("{\"error\": \"%s: %s\"}\n", what, strerror(errno));
    exit(1);
}

static int connect_one(void) {
    int fd;
    if (unix_path) {
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strncpy(a.sun_path, unix_path, sizeof(a.sun_path) - 1);
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0) die("connect unix");
    } else {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
        if (inet_pton(AF_INET, host, &a.sin_addr) != 1) die("address");
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0) die("connect tcp");
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    fcntl(fd, F_SETFL, O_NONBLOCK);
    return fd;
}

static void send_requests(conn_t *c, int n) {
    static char out[1 << 22];
    size_t len = 0;
    double t = now();
    for (int i = 0; i < n; i++) {
        memcpy(out + len, request, request_len);
        if (binary) {
            uint32_t opaque = htonl(c->next_opaque++);
            for (int p = 0; p < npackets; p++) memcpy(out + len + opaque_at[p], &opaque, 4);
        }
        len += request_len;
        c->sent_at[c->tail] = t;
        c->tail = (c->tail + 1) % depth;
        c->inflight++;
    }
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(c->fd, out + off, len - off);
        if (w < 0) {
            if (errno == EAGAIN) continue; /* tiny requests: the socket buffer drains at once */
            die("write");
        }
        off += (size_t)w;
    }
}

static void keep_value(conn_t *c, const char *p, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') { errors_seen++; return; }
        v = v * 10 + (uint64_t)(p[i] - '0');
    }
    if (increasing) {
        if (v <= c->last_value) not_increasing++;
        c->last_value = v;
    }
    if (!unique) return;
    if (nvalues == capvalues) {
        capvalues = capvalues ? capvalues * 2 : 1 << 20;
        values = realloc(values, capvalues * sizeof(uint64_t));
        if (!values) die("realloc");
    }
    values[nvalues++] = v;
}

/* Parse one complete response at buf; return bytes used, 0 if incomplete, -1 if malformed. */
static long parse_response(conn_t *c, const char *buf, size_t len) {
    size_t pos = 0;
    for (int k = 0; k < nkeys; k++) {
        const char *eol = memmem(buf + pos, len - pos, "\r\n", 2);
        if (!eol) return 0;
        size_t line_len = (size_t)(eol - (buf + pos));
        /* VALUE <key> 0 <len> */
        if (line_len < 6 || memcmp(buf + pos, "VALUE ", 6) != 0) return -1;
        const char *p = buf + pos + 6;
        if ((size_t)(eol - p) < keylens[k] + 3 || memcmp(p, keys[k], keylens[k]) != 0) return -1;
        p += keylens[k];
        if (memcmp(p, " 0 ", 3) != 0) return -1;
        p += 3;
        size_t dlen = 0;
        if (p == eol) return -1;
        for (; p < eol; p++) {
            if (*p < '0' || *p > '9') return -1;
            dlen = dlen * 10 + (size_t)(*p - '0');
        }
        pos += line_len + 2;
        if (len - pos < dlen + 2) return 0;
        if (buf[pos + dlen] != '\r' || buf[pos + dlen + 1] != '\n') return -1;
        keep_value(c, buf + pos, dlen);
        pos += dlen + 2;
    }
    if (len - pos < 5) return 0;
    if (memcmp(buf + pos, "END\r\n", 5) != 0) return -1;
    return (long)(pos + 5);
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* One complete binary response (npackets packets) at buf; bytes used, 0 if incomplete, -1 if wrong. */
static long parse_binary_response(conn_t *c, const char *cbuf, size_t len) {
    const unsigned char *buf = (const unsigned char *)cbuf;
    size_t pos = 0;
    uint32_t opaque = c->expect_opaque;
    for (int k = 0; k < npackets; k++) {
        if (len - pos < 24) return 0;
        const unsigned char *h = buf + pos;
        uint32_t bodylen = be32(h + 8);
        if (len - pos < 24 + (size_t)bodylen) return 0;
        size_t keylen = (size_t)h[2] << 8 | h[3], extlen = h[4];
        if (h[0] != 0x81 || h[6] != 0 || h[7] != 0 || be32(h + 12) != opaque) return -1;
        if (nkeys > 1 && k == nkeys) { /* the NOOP that ends a quiet multi-get */
            if (h[1] != 0x0a || bodylen != 0) return -1;
        } else {
            int opcode = nkeys > 1 ? 0x0d : 0x00;
            size_t want_key = nkeys > 1 ? keylens[k] : 0;
            if (h[1] != opcode || extlen != 4 || keylen != want_key || bodylen <= extlen + keylen) return -1;
            if (memcmp(h + 24, "\0\0\0\0", 4) != 0) return -1;
            if (want_key && memcmp(h + 28, keys[k], want_key) != 0) return -1;
            keep_value(c, (const char *)h + 28 + keylen, bodylen - extlen - keylen);
        }
        pos += 24 + bodylen;
    }
    c->expect_opaque++;
    return (long)pos;
}

static size_t binary_packet(char *out, int opcode, const char *key, size_t keylen) {
    unsigned char *h = (unsigned char *)out;
    memset(h, 0, 24);
    h[0] = 0x80;
    h[1] = (unsigned char)opcode;
    h[2] = (unsigned char)(keylen >> 8);
    h[3] = (unsigned char)keylen;
    uint32_t body = htonl((uint32_t)keylen);
    memcpy(h + 8, &body, 4);
    memcpy(out + 24, key, keylen);
    return 24 + keylen;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double percentile(double q) {
    uint64_t target = (uint64_t)(q * (double)responses), seen = 0;
    for (int i = 0; i < HIST_US; i++) {
        seen += hist[i];
        if (seen > target) return i;
    }
    return HIST_US;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--host")) host = argv[++i];
        else if (!strcmp(argv[i], "--port")) port = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--unix")) unix_path = argv[++i];
        else if (!strcmp(argv[i], "--conns")) nconns = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--depth")) depth = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--keys")) nkeys = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--unique")) unique = 1;
        else if (!strcmp(argv[i], "--increasing")) increasing = 1;
        else if (!strcmp(argv[i], "--binary")) binary = 1;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (nkeys < 1 || nkeys > 1024 || depth < 1 || nconns < 1) { fprintf(stderr, "bad sizes\n"); return 2; }
    for (int k = 0; k < nkeys; k++) keylens[k] = (size_t)snprintf(keys[k], sizeof(keys[k]), "k%d", k);
    if (binary) {
        /* one GET, or GETKQ per key then a NOOP: every packet of a request carries its opaque */
        npackets = nkeys > 1 ? nkeys + 1 : 1;
        request_len = 0;
        for (int k = 0; k < nkeys; k++) {
            opaque_at[k] = request_len + 12;
            request_len += binary_packet(request + request_len, nkeys > 1 ? 0x0d : 0x00, keys[k], keylens[k]);
        }
        if (nkeys > 1) {
            opaque_at[nkeys] = request_len + 12;
            request_len += binary_packet(request + request_len, 0x0a, "", 0);
        }
    } else {
        request_len = (size_t)snprintf(request, sizeof(request), "get");
        for (int k = 0; k < nkeys; k++)
            request_len += (size_t)snprintf(request + request_len, sizeof(request) - request_len, " %s", keys[k]);
        request_len += (size_t)snprintf(request + request_len, sizeof(request) - request_len, "\r\n");
    }
    hist = calloc(HIST_US, sizeof(uint64_t));

    int ep = epoll_create1(0);
    conn_t *conns = calloc((size_t)nconns, sizeof(conn_t));
    for (int i = 0; i < nconns; i++) {
        conns[i].fd = connect_one();
        conns[i].rbuf = malloc(RBUF);
        conns[i].sent_at = calloc((size_t)depth, sizeof(double));
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &conns[i]};
        epoll_ctl(ep, EPOLL_CTL_ADD, conns[i].fd, &ev);
    }
    double start = now(), deadline = start + seconds;
    for (int i = 0; i < nconns; i++) send_requests(&conns[i], depth);
    struct epoll_event events[1024];
    int stopping = 0, open_requests = nconns * depth;
    while (open_requests > 0) {
        int n = epoll_wait(ep, events, 1024, 5000);
        if (n < 0) { if (errno == EINTR) continue; die("epoll"); }
        if (n == 0) { printf("{\"error\": \"server stopped answering\"}\n"); return 1; }
        double t = now();
        if (t >= deadline) stopping = 1;
        for (int e = 0; e < n; e++) {
            conn_t *c = events[e].data.ptr;
            ssize_t r = read(c->fd, c->rbuf + c->rlen, RBUF - c->rlen);
            if (r < 0 && errno == EAGAIN) continue;
            if (r <= 0) { printf("{\"error\": \"connection closed by server\"}\n"); return 1; }
            c->rlen += (size_t)r;
            size_t pos = 0;
            int done = 0;
            for (;;) {
                long used = binary ? parse_binary_response(c, c->rbuf + pos, c->rlen - pos)
                                   : parse_response(c, c->rbuf + pos, c->rlen - pos);
                if (used < 0) {
                    if (binary) {
                        printf("{\"error\": \"malformed binary response at byte %zu\"}\n", pos);
                    } else {
                        printf("{\"error\": \"malformed response: %.60s\"}\n", c->rbuf + pos);
                    }
                    return 1;
                }
                if (used == 0) break;
                pos += (size_t)used;
                double lat_us = (t - c->sent_at[c->head]) * 1e6;
                c->head = (c->head + 1) % depth;
                c->inflight--;
                hist[lat_us < HIST_US ? (int)lat_us : HIST_US - 1]++;
                responses++;
                done++;
            }
            memmove(c->rbuf, c->rbuf + pos, c->rlen - pos);
            c->rlen -= pos;
            open_requests -= done;
            if (!stopping && done) {
                send_requests(c, done);
                open_requests += done;
            }
        }
    }
    double elapsed = now() - start;
    uint64_t duplicates = 0;
    if (unique && nvalues > 1) {
        qsort(values, nvalues, sizeof(uint64_t), cmp_u64);
        for (size_t i = 1; i < nvalues; i++) duplicates += values[i] == values[i - 1];
    }
    printf("{\"requests\": %llu, \"elapsed\": %.6f, \"rps\": %.1f, \"values_per_s\": %.1f, "
           "\"p50_us\": %.0f, \"p99_us\": %.0f, \"bad_values\": %llu, \"checked_unique\": %llu, "
           "\"duplicates\": %llu, \"not_increasing\": %llu}\n",
           (unsigned long long)responses, elapsed, responses / elapsed, responses * (double)nkeys / elapsed,
           percentile(0.50), percentile(0.99), (unsigned long long)errors_seen,
           (unsigned long long)(unique ? nvalues : 0), (unsigned long long)duplicates,
           (unsigned long long)not_increasing);
    return errors_seen || duplicates || not_increasing ? 1 : 0;
}
