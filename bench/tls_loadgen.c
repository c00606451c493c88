/*
 * A small memcached-over-TLS load generator for bench/tls_bench.py (text protocol, GET of --keys keys).
 *
 * Why C: a Python TLS client would limit the figures long before either server does. One thread per
 * connection, blocking OpenSSL I/O, one request in flight per connection (request, then its whole
 * reply); every reply is checked: --keys VALUE lines then END. The handshake is done before the clock
 * starts (TLS 1.3 unless the server offers only 1.2), so the figures are of the steady state.
 *
 * Build: cc -O2 -o tls_loadgen tls_loadgen.c -lssl -lcrypto -lpthread
 * Output: one JSON object on stdout: {"requests": N, "seconds": S, "errors": E}.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int port, keys, conns;
static double seconds;
static SSL_CTX *ctx;
static char request[8192];
static size_t request_len;
static atomic_long total_requests, total_errors;
static atomic_int ready_count;
static volatile int go, stop;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    (void)arg;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        perror("connect");
        exit(1);
    }
    SSL *ssl = SSL_new(ctx);
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) != 1) {
        ERR_print_errors_fp(stderr);
        exit(1);
    }
    static __thread char buf[1 << 16];
    atomic_fetch_add(&ready_count, 1);
    while (!go)
        usleep(1000);
    long done = 0, errors = 0;
    while (!stop) {
        if (SSL_write(ssl, request, (int)request_len) != (int)request_len) {
            errors++;
            break;
        }
        size_t len = 0;
        for (;;) { /* until the reply ends with END\r\n */
            int n = SSL_read(ssl, buf + len, (int)(sizeof buf - len));
            if (n <= 0) {
                errors++;
                goto out;
            }
            len += (size_t)n;
            if (len >= 5 && memcmp(buf + len - 5, "END\r\n", 5) == 0)
                break;
            if (len == sizeof buf) {
                errors++;
                goto out;
            }
        }
        int values = 0;
        for (char *p = buf; (p = memmem(p, (size_t)(buf + len - p), "VALUE ", 6)) != NULL; p += 6)
            values++;
        if (values != keys)
            errors++;
        done++;
    }
out:
    atomic_fetch_add(&total_requests, done);
    atomic_fetch_add(&total_errors, errors);
    SSL_shutdown(ssl);
    SSL_free(ssl);
    close(fd);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s PORT CONNECTIONS KEYS SECONDS CAFILE\n", argv[0]);
        return 2;
    }
    port = atoi(argv[1]);
    conns = atoi(argv[2]);
    keys = atoi(argv[3]);
    seconds = atof(argv[4]);
    ctx = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    if (SSL_CTX_load_verify_locations(ctx, argv[5], NULL) != 1) {
        ERR_print_errors_fp(stderr);
        return 1;
    }
    size_t pos = (size_t)snprintf(request, sizeof request, "get");
    for (int i = 0; i < keys; i++)
        pos += (size_t)snprintf(request + pos, sizeof request - pos, " k%d", i);
    pos += (size_t)snprintf(request + pos, sizeof request - pos, "\r\n");
    request_len = pos;
    pthread_t *threads = calloc((size_t)conns, sizeof *threads);
    for (int i = 0; i < conns; i++)
        pthread_create(&threads[i], NULL, worker, NULL);
    while (atomic_load(&ready_count) < conns)
        usleep(1000);
    double started = now();
    go = 1;
    usleep((useconds_t)(seconds * 1e6));
    stop = 1;
    double elapsed = now() - started;
    for (int i = 0; i < conns; i++)
        pthread_join(threads[i], NULL);
    printf("{\"requests\": %ld, \"seconds\": %.4f, \"errors\": %ld}\n", atomic_load(&total_requests), elapsed,
           atomic_load(&total_errors));
    return 0;
}
