/*
 * katsubushi_py._grpc_speedups: the compiled twin of the gRPC fast path.
 *
 *   GrpcCore  twin of frontends/grpc_fast.py PyGrpcCore: the steady state of Generator.Fetch and
 *             Generator.FetchMulti over HTTP/2. A HEADERS frame whose header block the slow path
 *             recognised before (_cache_add), the stream's DATA frame with its one message and
 *             END_STREAM, answered with precomputed HEADERS, a DATA frame with the IDs and the
 *             trailers; connection WINDOW_UPDATEs, and the per-stream ones grpcio sends before its
 *             DATA. At the first frame it does not take it hands the rest of the input (after the
 *             HEADERS frames of the calls it had started) to the Python _receive_slow, which is the
 *             whole protocol (h2).
 *
 * The rule that keeps the twins identical: C does exactly what PyGrpcCore.receive does for the same
 * input in the same state, step by step, and gives up where it gives up. tests/test_grpc_h2.py
 * compares the two byte for byte on generated conversations (tests/test_grpc_twins.py).
 *
 * A module of its own (not _speedups.c), built by setup.py as a second optional extension with the
 * same tolerance of a missing compiler; katsubushi_py/compiled.py chooses it under the same rules.
 * It knows the generator only by its next_id and next_ids methods (bound, called directly) and the
 * counters by their commands and ids attributes, so it works with either twin of both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_FRAME 16384
#define MAX_STREAMS 100
#define CACHE_SIZE 16
/* WINDOW_UPDATEs taken since the last call answered before the rest go to the slow path, whose frame
 * budget counts them (grpc_frames.IDLE_WINDOW_UPDATES; issue 33). */
#define IDLE_WINDOW_UPDATES 1000
#define RETURN_AT (65535 / 2)
/* Fairness (issue 33): a pass stops once it has spent PIECE_BUDGET (a call's reply bytes plus
 * CALL_COST), holding the rest (backlog) for the connection glue's next slice (grpc_frames). */
#define PIECE_BUDGET (16 * 1024)
#define CALL_COST 256
#define MAX_IDS 1000
#define WINDOW_MAX 0x7FFFFFFFLL

#define T_DATA 0
#define T_HEADERS 1
#define T_WINDOW_UPDATE 8
#define F_END_STREAM 0x1
#define F_END_HEADERS 0x4

#define M_FETCH 1

static PyObject *str_receive_slow, *str_commands, *str_ids, *empty_bytes;

static Py_ssize_t member_offset(PyObject *obj, const char *name);

/* The reply's header blocks: see REPLY_HEADERS, REPLY_BLOCK, TRAILERS, TRAILERS_BLOCK in grpc_frames.py. */
static const unsigned char REPLY_HEAD[5] = {0x00, 0x00, 0x14, 0x01, 0x04};
static const unsigned char REPLY_BLOCK[20] = {0x88, 0x0f, 0x10, 0x10, 'a', 'p', 'p', 'l', 'i', 'c',
                                              'a', 't', 'i', 'o', 'n', '/', 'g', 'r', 'p', 'c'};
static const unsigned char TRAILERS_HEAD[5] = {0x00, 0x00, 0x0f, 0x01, 0x05};
static const unsigned char TRAILERS_BLOCK[15] = {0x00, 0x0b, 'g', 'r', 'p', 'c', '-', 's', 't', 'a',
                                                 't', 'u', 's', 0x01, '0'};

typedef struct {
    long long sid;
    int method;
    PyObject *block;  /* the header block (a strong reference) */
    long long opened; /* what the client added to the stream's window */
    long long length; /* the request's content-length, -1 if none: its DATA must match */
} Pending;

typedef struct {
    PyObject_HEAD
    PyObject *buffer; /* _buffer: bytes of an incomplete frame */
    PyObject *next_id;
    PyObject *next_ids;
    PyObject *counters;
    PyObject *cache_keys[CACHE_SIZE];
    int cache_codes[CACHE_SIZE];
    long long cache_lengths[CACHE_SIZE];
    int cache_len;
    Pending pending[MAX_STREAMS];
    int npending;
    long long last_stream, out_window, peer_window, in_window, debt, activity, handed;
    long long idle; /* WINDOW_UPDATEs taken since the last call answered */
    long long spent; /* _spent: this receive's (or resume's) work, both paths' (PIECE_BUDGET) */
    Py_ssize_t commands_at, ids_at; /* offsets of the counters' C integers (_speedups.Counters); -1: use attributes */
    double wait;
    char fast, closing, backlog;
} GrpcCore;

/* A growing output buffer. */
typedef struct {
    unsigned char *p;
    Py_ssize_t len, cap;
} Out;

static int
out_reserve(Out *o, Py_ssize_t more)
{
    if (o->len + more <= o->cap)
        return 0;
    Py_ssize_t cap = o->cap ? o->cap : 1024;
    while (cap < o->len + more)
        cap *= 2;
    unsigned char *p = PyMem_Realloc(o->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->p = p;
    o->cap = cap;
    return 0;
}

/* Append a bytes object. An empty one copies nothing: acc.p may still be NULL, and memcpy from or to
 * NULL is undefined even for 0 bytes (UndefinedBehaviorSanitizer found this one, issue 23). */
static int
out_put_bytes(Out *o, PyObject *bytes)
{
    Py_ssize_t n = PyBytes_GET_SIZE(bytes);
    if (n == 0)
        return 0;
    if (out_reserve(o, n) < 0)
        return -1;
    memcpy(o->p + o->len, PyBytes_AS_STRING(bytes), n);
    o->len += n;
    return 0;
}

static inline unsigned char *
put_be(unsigned char *p, unsigned long long v, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
    return p + n;
}

static inline int
put_varint(unsigned char *p, unsigned long long v)
{
    int n = 0;
    while (v > 0x7f) {
        p[n++] = (unsigned char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    p[n++] = (unsigned char)v;
    return n;
}

static int
emit_window_update(Out *o, long long sid, long long increment)
{
    if (out_reserve(o, 13) < 0)
        return -1;
    unsigned char *p = o->p + o->len;
    p = put_be(p, 4, 3);
    *p++ = T_WINDOW_UPDATE;
    *p++ = 0;
    p = put_be(p, (unsigned long long)sid, 4);
    put_be(p, (unsigned long long)increment, 4);
    o->len += 13;
    return 0;
}

/* The three frames of one answered call (grpc_frames.reply_frames). */
static int
emit_reply(Out *o, long long sid, const unsigned char *message, Py_ssize_t n)
{
    if (out_reserve(o, 29 + 14 + n + 24) < 0)
        return -1;
    unsigned char *p = o->p + o->len;
    memcpy(p, REPLY_HEAD, 5);
    p = put_be(p + 5, (unsigned long long)sid, 4);
    memcpy(p, REPLY_BLOCK, 20);
    p += 20;
    p = put_be(p, (unsigned long long)(n + 5), 3);
    *p++ = T_DATA;
    *p++ = 0;
    p = put_be(p, (unsigned long long)sid, 4);
    *p++ = 0;
    p = put_be(p, (unsigned long long)n, 4);
    if (n)
        memcpy(p, message, n);
    p += n;
    memcpy(p, TRAILERS_HEAD, 5);
    p = put_be(p + 5, (unsigned long long)sid, 4);
    memcpy(p, TRAILERS_BLOCK, 15);
    p += 15;
    o->len = p - o->p;
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */

static void
pending_clear(GrpcCore *self)
{
    for (int i = 0; i < self->npending; i++)
        Py_CLEAR(self->pending[i].block);
    self->npending = 0;
}

static void
pending_pop_front(GrpcCore *self)
{
    Py_CLEAR(self->pending[0].block);
    self->npending--;
    memmove(&self->pending[0], &self->pending[1], sizeof(Pending) * self->npending);
}

static void
cache_clear(GrpcCore *self)
{
    for (int i = 0; i < self->cache_len; i++)
        Py_CLEAR(self->cache_keys[i]);
    self->cache_len = 0;
}

/* The index of block in the cache, -1 if absent. */
static int
cache_find(GrpcCore *self, const char *block, Py_ssize_t n)
{
    for (int i = 0; i < self->cache_len; i++) {
        PyObject *key = self->cache_keys[i];
        if (PyBytes_GET_SIZE(key) == n && memcmp(PyBytes_AS_STRING(key), block, n) == 0)
            return i;
    }
    return -1;
}

static PyObject *
GrpcCore_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    GrpcCore *self = (GrpcCore *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(empty_bytes);
    self->buffer = empty_bytes;
    self->out_window = self->peer_window = self->in_window = 65535;
    self->commands_at = self->ids_at = -1;
    return (PyObject *)self;
}

static int
GrpcCore_traverse(GrpcCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buffer);
    Py_VISIT(self->next_id);
    Py_VISIT(self->next_ids);
    Py_VISIT(self->counters);
    for (int i = 0; i < self->cache_len; i++)
        Py_VISIT(self->cache_keys[i]);
    for (int i = 0; i < self->npending; i++)
        Py_VISIT(self->pending[i].block);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
GrpcCore_clear(GrpcCore *self)
{
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->next_id);
    Py_CLEAR(self->next_ids);
    Py_CLEAR(self->counters);
    cache_clear(self);
    pending_clear(self);
    return 0;
}

static void
GrpcCore_dealloc(GrpcCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GrpcCore_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* _core_init(generator, counters) */
static PyObject *
GrpcCore_core_init(GrpcCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_core_init(generator, counters)");
        return NULL;
    }
    PyObject *next_id = PyObject_GetAttrString(args[0], "next_id");
    if (next_id == NULL)
        return NULL;
    PyObject *next_ids = PyObject_GetAttrString(args[0], "next_ids");
    if (next_ids == NULL) {
        Py_DECREF(next_id);
        return NULL;
    }
    Py_XSETREF(self->next_id, next_id);
    Py_XSETREF(self->next_ids, next_ids);
    Py_INCREF(args[1]);
    Py_XSETREF(self->counters, args[1]);
    self->commands_at = member_offset(args[1], "commands");
    self->ids_at = member_offset(args[1], "ids");
    if (PyErr_Occurred())
        return NULL;
    Py_INCREF(empty_bytes);
    Py_XSETREF(self->buffer, empty_bytes);
    self->fast = 0;
    cache_clear(self);
    pending_clear(self);
    self->last_stream = 0;
    self->out_window = self->peer_window = self->in_window = 65535;
    self->debt = 0;
    self->handed = 0;
    self->idle = 0;
    self->activity = 0;
    self->closing = 0;
    self->wait = 0.0;
    Py_RETURN_NONE;
}

static PyObject *
GrpcCore_cache_add(GrpcCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "_cache_add(block: bytes, method: int, length: int)");
        return NULL;
    }
    long method = PyLong_AsLong(args[1]);
    if (method == -1 && PyErr_Occurred())
        return NULL;
    long long length = PyLong_AsLongLong(args[2]);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    if (cache_find(self, PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0])) >= 0)
        Py_RETURN_NONE;
    if (self->cache_len >= CACHE_SIZE)
        cache_clear(self);
    Py_INCREF(args[0]);
    self->cache_keys[self->cache_len] = args[0];
    self->cache_codes[self->cache_len] = (int)method;
    self->cache_lengths[self->cache_len] = length;
    self->cache_len++;
    Py_RETURN_NONE;
}

/* _pending_add(stream_id, method, block, length): a call whose headers the slow path decoded. */
static PyObject *
GrpcCore_pending_add(GrpcCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "_pending_add(stream_id: int, method: int, block: bytes, length: int)");
        return NULL;
    }
    long long sid = PyLong_AsLongLong(args[0]);
    long method = PyLong_AsLong(args[1]);
    long long length = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (self->npending >= MAX_STREAMS) {
        PyErr_SetString(PyExc_OverflowError, "too many calls pending");
        return NULL;
    }
    Pending *c = &self->pending[self->npending++];
    c->sid = sid;
    c->method = (int)method;
    Py_INCREF(args[2]);
    c->block = args[2];
    c->opened = 0;
    c->length = length;
    Py_RETURN_NONE;
}

static PyObject *
GrpcCore_cache_clear(GrpcCore *self, PyObject *Py_UNUSED(ignored))
{
    cache_clear(self);
    Py_RETURN_NONE;
}

static PyObject *
GrpcCore_cache_len(GrpcCore *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(self->cache_len);
}

/* The frames of the calls started (HEADERS, then a WINDOW_UPDATE if the client opened the stream's
 * window), appended to o; forgets them. */
static int
pending_frames(GrpcCore *self, Out *o)
{
    for (int i = 0; i < self->npending; i++) {
        Pending *c = &self->pending[i];
        Py_ssize_t n = PyBytes_GET_SIZE(c->block);
        if (out_reserve(o, 9 + n) < 0)
            return -1;
        unsigned char *p = o->p + o->len;
        p = put_be(p, (unsigned long long)n, 3);
        *p++ = T_HEADERS;
        *p++ = F_END_HEADERS;
        p = put_be(p, (unsigned long long)c->sid, 4);
        memcpy(p, PyBytes_AS_STRING(c->block), n);
        o->len += 9 + n;
        if (c->opened && emit_window_update(o, c->sid, c->opened) < 0)
            return -1;
    }
    pending_clear(self);
    return 0;
}

static PyObject *
GrpcCore_pending_frames(GrpcCore *self, PyObject *Py_UNUSED(ignored))
{
    Out o = {NULL, 0, 0};
    if (pending_frames(self, &o) < 0) {
        PyMem_Free(o.p);
        return NULL;
    }
    PyObject *r = PyBytes_FromStringAndSize((const char *)o.p, o.len);
    PyMem_Free(o.p);
    return r;
}

/* The offset of a writable long long member of obj's type (the compiled Counters' commands and ids),
 * so that counting costs no attribute lookups; -1 if it is not one (the pure-Python PyCounters). */
static Py_ssize_t
member_offset(PyObject *obj, const char *name)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), name);
    if (descr == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t at = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type == T_LONGLONG && !(m->flags & READONLY))
            at = m->offset;
    }
    Py_DECREF(descr);
    return at;
}

static int
bump(PyObject *obj, Py_ssize_t at, PyObject *name, long long by)
{
    if (at >= 0) {
        *(long long *)((char *)obj + at) += by;
        return 0;
    }
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    PyObject *delta = PyLong_FromLongLong(by);
    if (delta == NULL) {
        Py_DECREF(v);
        return -1;
    }
    PyObject *sum = PyNumber_Add(v, delta);
    Py_DECREF(v);
    Py_DECREF(delta);
    if (sum == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return r;
}

static unsigned char ids_buffer[5 + 1 + 3 + 10 * MAX_IDS];

/* The reply message of one call into ids_buffer (its length in *n); 0 done, 1 give up (an exception
 * from the generator: a clock wait or a failure, which the slow path meets again), -1 error. */
static int
issue(GrpcCore *self, int method, long long count, Py_ssize_t *n)
{
    if (method == M_FETCH || count == 1) {
        PyObject *v = PyObject_CallNoArgs(self->next_id);
        if (v == NULL) {
            PyErr_Clear();
            return 1;
        }
        unsigned long long id = PyLong_AsUnsignedLongLong(v);
        Py_DECREF(v);
        if (id == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (method == M_FETCH) {
            if (id == 0) {
                *n = 0;
            } else {
                ids_buffer[0] = 0x08;
                *n = 1 + put_varint(ids_buffer + 1, id);
            }
        } else {
            unsigned char body[10];
            int len = put_varint(body, id);
            ids_buffer[0] = 0x0a;
            int at = 1 + put_varint(ids_buffer + 1, (unsigned long long)len);
            memcpy(ids_buffer + at, body, len);
            *n = at + len;
        }
        return 0;
    }
    PyObject *arg = PyLong_FromLongLong(count);
    if (arg == NULL)
        return -1;
    PyObject *list = PyObject_CallOneArg(self->next_ids, arg);
    Py_DECREF(arg);
    if (list == NULL) {
        PyErr_Clear();
        return 1;
    }
    if (!PyList_Check(list)) {
        Py_DECREF(list);
        return 1;
    }
    Py_ssize_t k = PyList_GET_SIZE(list);
    if (k == 0) {
        Py_DECREF(list);
        *n = 0;
        return 0;
    }
    if (k > MAX_IDS) {
        Py_DECREF(list);
        return 1;
    }
    /* The body first, after room for the tag and a length of up to three bytes; then move it up. */
    unsigned char *body = ids_buffer + 4;
    Py_ssize_t len = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        unsigned long long id = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(list, i));
        if (id == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(list);
            return 1;
        }
        len += put_varint(body + len, id);
    }
    Py_DECREF(list);
    unsigned char head[4];
    head[0] = 0x0a;
    int hn = 1 + put_varint(head + 1, (unsigned long long)len);
    memmove(ids_buffer + hn, body, len);
    memcpy(ids_buffer, head, hn);
    *n = hn + len;
    return 0;
}

static inline unsigned long long
get_be(const unsigned char *p, int n)
{
    unsigned long long v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* One run of the fast path over _buffer and data (PyGrpcCore._fast_pass); *slow says whether the
 * slow path ran. */
static PyObject *
fast_pass(GrpcCore *self, PyObject *data, int *slow)
{
    PyObject *buf;
    *slow = 0;
    if (!PyBytes_Check(data)) {
        buf = PyBytes_FromObject(data);
        if (buf == NULL)
            return NULL;
        if (PyBytes_GET_SIZE(self->buffer)) {
            PyObject *joined = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(self->buffer) + PyBytes_GET_SIZE(buf));
            if (joined == NULL) {
                Py_DECREF(buf);
                return NULL;
            }
            memcpy(PyBytes_AS_STRING(joined), PyBytes_AS_STRING(self->buffer), PyBytes_GET_SIZE(self->buffer));
            memcpy(PyBytes_AS_STRING(joined) + PyBytes_GET_SIZE(self->buffer), PyBytes_AS_STRING(buf),
                   PyBytes_GET_SIZE(buf));
            Py_SETREF(buf, joined);
        }
    } else if (PyBytes_GET_SIZE(self->buffer)) {
        Py_ssize_t held = PyBytes_GET_SIZE(self->buffer);
        buf = PyBytes_FromStringAndSize(NULL, held + PyBytes_GET_SIZE(data));
        if (buf == NULL)
            return NULL;
        memcpy(PyBytes_AS_STRING(buf), PyBytes_AS_STRING(self->buffer), held);
        memcpy(PyBytes_AS_STRING(buf) + held, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
    } else {
        Py_INCREF(data);
        buf = data;
    }
    Py_INCREF(empty_bytes);
    Py_SETREF(self->buffer, empty_bytes);

    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(buf);
    Py_ssize_t n = PyBytes_GET_SIZE(buf), pos = 0;
    Out o = {NULL, 0, 0};
    long long calls = 0, issued = 0;
    int give_up = 0;
    PyObject *result = NULL;

    while (n - pos >= 9) {
        Py_ssize_t length = (Py_ssize_t)get_be(b + pos, 3);
        if (length > MAX_FRAME) {
            give_up = 1;
            break;
        }
        Py_ssize_t end = pos + 9 + length;
        if (end > n)
            break;
        int kind = b[pos + 3], flags = b[pos + 4];
        long long sid = (long long)(get_be(b + pos + 5, 4) & 0x7fffffffULL);
        const unsigned char *payload = b + pos + 9;
        if (kind == T_HEADERS) {
            if (flags != F_END_HEADERS || !(sid & 1) || self->npending >= MAX_STREAMS) {
                give_up = 1;
                break;
            }
            if (sid <= (self->npending ? self->pending[self->npending - 1].sid : self->last_stream)) {
                give_up = 1;
                break;
            }
            int at = cache_find(self, (const char *)payload, length);
            if (at < 0) {
                give_up = 1;
                break;
            }
            Pending *c = &self->pending[self->npending++];
            c->sid = sid;
            c->method = self->cache_codes[at];
            Py_INCREF(self->cache_keys[at]);
            c->block = self->cache_keys[at];
            c->opened = 0;
            c->length = self->cache_lengths[at];
        } else if (kind == T_DATA) {
            if (flags != F_END_STREAM || !self->npending || self->pending[0].sid != sid || length < 5 || payload[0]) {
                give_up = 1;
                break;
            }
            Py_ssize_t size = (Py_ssize_t)get_be(payload + 1, 4);
            if (size != length - 5 || self->debt + length > self->in_window ||
                (self->pending[0].length != -1 && self->pending[0].length != length)) {
                give_up = 1;
                break;
            }
            int method = self->pending[0].method;
            long long count;
            const unsigned char *m = payload + 5;
            if (method == M_FETCH) {
                if (size) {
                    give_up = 1;
                    break;
                }
                count = 1;
            } else {
                if (size == 0)
                    count = 0;
                else if (size == 2 && m[0] == 0x08 && m[1] < 0x80)
                    count = m[1];
                else if (size == 3 && m[0] == 0x08 && m[1] >= 0x80 && m[2] < 0x80)
                    count = (m[1] & 0x7f) | ((long long)m[2] << 7);
                else {
                    give_up = 1;
                    break;
                }
                if (count == 0)
                    count = 1;
                if (count > MAX_IDS) {
                    give_up = 1;
                    break;
                }
            }
            long long bound = 5 + 3 + 10 * count;
            if (bound > self->out_window || bound > self->peer_window + self->pending[0].opened) {
                give_up = 1;
                break;
            }
            Py_ssize_t mlen;
            int r = issue(self, method, count, &mlen);
            if (r < 0)
                goto error;
            if (r > 0) {
                give_up = 1;
                break;
            }
            pending_pop_front(self);
            self->last_stream = sid;
            self->debt += length;
            if (self->debt >= RETURN_AT) {
                if (emit_window_update(&o, 0, self->debt) < 0)
                    goto error;
                self->debt = 0;
            }
            self->out_window -= mlen + 5;
            if (emit_reply(&o, sid, ids_buffer, mlen) < 0)
                goto error;
            calls++;
            self->idle = 0;
            issued += count;
            self->spent += mlen + CALL_COST;
            if (self->spent >= PIECE_BUDGET && n - end >= 9) { /* the rest in the glue's next slice */
                pos = end;
                self->backlog = 1;
                break;
            }
        } else if (kind == T_WINDOW_UPDATE && length == 4) {
            long long increment = (long long)(get_be(payload, 4) & 0x7fffffffULL);
            if (!increment || self->idle >= IDLE_WINDOW_UPDATES) {
                give_up = 1;
                break;
            }
            self->idle++;
            if (sid == 0) {
                if (self->out_window + increment > WINDOW_MAX) {
                    give_up = 1;
                    break;
                }
                self->out_window += increment;
            } else if (self->npending && self->pending[0].sid <= sid && sid <= self->pending[self->npending - 1].sid) {
                Pending *c = NULL;
                for (int i = 0; i < self->npending; i++) {
                    if (self->pending[i].sid == sid) {
                        c = &self->pending[i];
                        break;
                    }
                }
                if (c == NULL || self->peer_window + c->opened + increment > WINDOW_MAX) {
                    give_up = 1;
                    break;
                }
                c->opened += increment;
            } else if (!((sid & 1) && sid <= self->last_stream)) {
                give_up = 1;
                break;
            }
        } else {
            give_up = 1;
            break;
        }
        pos = end;
    }
    if (calls) {
        self->activity += calls;
        if (bump(self->counters, self->commands_at, str_commands, calls) < 0 ||
            bump(self->counters, self->ids_at, str_ids, issued) < 0)
            goto error;
    }
    if (!give_up) {
        if (pos < n) {
            PyObject *rest = PyBytes_FromStringAndSize((const char *)b + pos, n - pos);
            if (rest == NULL)
                goto error;
            Py_SETREF(self->buffer, rest);
        }
        result = PyBytes_FromStringAndSize((const char *)o.p, o.len);
        goto done;
    }
    {
        PyObject *rest;
        if (self->npending) {
            self->handed = self->pending[self->npending - 1].sid;
            Out h = {NULL, 0, 0};
            if (pending_frames(self, &h) < 0 || out_reserve(&h, n - pos) < 0) {
                PyMem_Free(h.p);
                goto error;
            }
            memcpy(h.p + h.len, b + pos, n - pos);
            h.len += n - pos;
            rest = PyBytes_FromStringAndSize((const char *)h.p, h.len);
            PyMem_Free(h.p);
        } else {
            rest = PyBytes_FromStringAndSize((const char *)b + pos, n - pos);
        }
        if (rest == NULL)
            goto error;
        *slow = 1;
        PyObject *part = PyObject_CallMethodOneArg((PyObject *)self, str_receive_slow, rest);
        Py_DECREF(rest);
        if (part == NULL)
            goto error;
        if (!PyBytes_Check(part)) {
            Py_DECREF(part);
            PyErr_SetString(PyExc_TypeError, "_receive_slow must return bytes");
            goto error;
        }
        if (o.len == 0) {
            result = part;
            goto done;
        }
        if (out_reserve(&o, PyBytes_GET_SIZE(part)) < 0) {
            Py_DECREF(part);
            goto error;
        }
        memcpy(o.p + o.len, PyBytes_AS_STRING(part), PyBytes_GET_SIZE(part));
        o.len += PyBytes_GET_SIZE(part);
        Py_DECREF(part);
        result = PyBytes_FromStringAndSize((const char *)o.p, o.len);
    }
done:
    PyMem_Free(o.p);
    Py_DECREF(buf);
    return result;
error:
    PyMem_Free(o.p);
    Py_DECREF(buf);
    return NULL;
}

/* receive(data): the fast path while it can, the slow path with the rest; and the fast path again
 * if the slow path stopped early, in steady state, leaving frames in _buffer (PyGrpcCore.receive). */
static PyObject *
GrpcCore_receive(GrpcCore *self, PyObject *data)
{
    PyObject *first = NULL;
    Out acc = {NULL, 0, 0};
    if (self->backlog) { /* a piece's budget is spent: hold what arrives behind the rest, until resume */
        PyObject *more = PyBytes_FromObject(data);
        if (more == NULL)
            return NULL;
        if (PyBytes_GET_SIZE(more)) {
            Py_ssize_t held = PyBytes_GET_SIZE(self->buffer);
            PyObject *joined = PyBytes_FromStringAndSize(NULL, held + PyBytes_GET_SIZE(more));
            if (joined == NULL) {
                Py_DECREF(more);
                return NULL;
            }
            memcpy(PyBytes_AS_STRING(joined), PyBytes_AS_STRING(self->buffer), held);
            memcpy(PyBytes_AS_STRING(joined) + held, PyBytes_AS_STRING(more), PyBytes_GET_SIZE(more));
            Py_SETREF(self->buffer, joined);
        }
        Py_DECREF(more);
        Py_INCREF(empty_bytes);
        return empty_bytes;
    }
    self->spent = 0; /* a new piece: both paths spend from it */
    Py_INCREF(data);
    for (;;) {
        PyObject *part;
        int slow = 1;
        if (!self->fast)
            part = PyObject_CallMethodOneArg((PyObject *)self, str_receive_slow, data);
        else
            part = fast_pass(self, data, &slow);
        Py_DECREF(data);
        if (part == NULL)
            goto error;
        if (!PyBytes_Check(part)) {
            Py_DECREF(part);
            PyErr_SetString(PyExc_TypeError, "_receive_slow must return bytes");
            goto error;
        }
        if (first == NULL && acc.len == 0) {
            first = part;
        } else {
            if (first != NULL) {
                if (out_put_bytes(&acc, first) < 0) {
                    Py_DECREF(part);
                    goto error;
                }
                Py_CLEAR(first);
            }
            if (out_put_bytes(&acc, part) < 0) {
                Py_DECREF(part);
                goto error;
            }
            Py_DECREF(part);
        }
        if (!slow || !self->fast || self->backlog || PyBytes_GET_SIZE(self->buffer) < 9)
            break;
        Py_INCREF(empty_bytes);
        data = empty_bytes;
    }
    if (first != NULL)
        return first;
    PyObject *result = PyBytes_FromStringAndSize((const char *)acc.p, acc.len);
    PyMem_Free(acc.p);
    return result;
error:
    Py_XDECREF(first);
    PyMem_Free(acc.p);
    return NULL;
}

static PyObject *
GrpcCore_get_buffer(GrpcCore *self, void *c)
{
    Py_INCREF(self->buffer);
    return self->buffer;
}

static int
GrpcCore_set_buffer(GrpcCore *self, PyObject *v, void *c)
{
    if (v == NULL || !PyBytes_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "_buffer must be bytes");
        return -1;
    }
    Py_INCREF(v);
    Py_SETREF(self->buffer, v);
    return 0;
}

static PyMethodDef GrpcCore_methods[] = {
    {"receive", (PyCFunction)GrpcCore_receive, METH_O, "Answer what arrived (fast path, then the slow path)."},
    {"_core_init", (PyCFunction)(void (*)(void))GrpcCore_core_init, METH_FASTCALL, NULL},
    {"_cache_add", (PyCFunction)(void (*)(void))GrpcCore_cache_add, METH_FASTCALL, NULL},
    {"_cache_clear", (PyCFunction)GrpcCore_cache_clear, METH_NOARGS, NULL},
    {"_pending_add", (PyCFunction)(void (*)(void))GrpcCore_pending_add, METH_FASTCALL, NULL},
    {"_cache_len", (PyCFunction)GrpcCore_cache_len, METH_NOARGS, NULL},
    {"_pending_frames", (PyCFunction)GrpcCore_pending_frames, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef GrpcCore_members[] = {
    {"_fast", T_BOOL, offsetof(GrpcCore, fast), 0, NULL},
    {"_last_stream", T_LONGLONG, offsetof(GrpcCore, last_stream), 0, NULL},
    {"_out_window", T_LONGLONG, offsetof(GrpcCore, out_window), 0, NULL},
    {"_peer_window", T_LONGLONG, offsetof(GrpcCore, peer_window), 0, NULL},
    {"_in_window", T_LONGLONG, offsetof(GrpcCore, in_window), 0, NULL},
    {"_debt", T_LONGLONG, offsetof(GrpcCore, debt), 0, NULL},
    {"_handed", T_LONGLONG, offsetof(GrpcCore, handed), 0, NULL},
    {"_spent", T_LONGLONG, offsetof(GrpcCore, spent), 0, NULL},
    {"activity", T_LONGLONG, offsetof(GrpcCore, activity), 0, NULL},
    {"closing", T_BOOL, offsetof(GrpcCore, closing), 0, NULL},
    {"backlog", T_BOOL, offsetof(GrpcCore, backlog), 0, NULL},
    {"wait", T_DOUBLE, offsetof(GrpcCore, wait), 0, NULL},
    {NULL},
};

static PyGetSetDef GrpcCore_getset[] = {
    {"_buffer", (getter)GrpcCore_get_buffer, (setter)GrpcCore_set_buffer, NULL, NULL},
    {NULL},
};

static PyType_Slot GrpcCore_slots[] = {
    {Py_tp_new, GrpcCore_new},
    {Py_tp_dealloc, GrpcCore_dealloc},
    {Py_tp_traverse, GrpcCore_traverse},
    {Py_tp_clear, GrpcCore_clear},
    {Py_tp_methods, GrpcCore_methods},
    {Py_tp_members, GrpcCore_members},
    {Py_tp_getset, GrpcCore_getset},
    {Py_tp_doc, "The gRPC fast path (compiled twin of PyGrpcCore)."},
    {0, NULL},
};

static PyType_Spec GrpcCore_spec = {
    "katsubushi_py._grpc_speedups.GrpcCore",
    sizeof(GrpcCore),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    GrpcCore_slots,
};

static int
grpc_speedups_exec(PyObject *m)
{
    str_receive_slow = PyUnicode_InternFromString("_receive_slow");
    str_commands = PyUnicode_InternFromString("commands");
    str_ids = PyUnicode_InternFromString("ids");
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    if (!str_receive_slow || !str_commands || !str_ids || !empty_bytes)
        return -1;
    PyTypeObject *core = (PyTypeObject *)PyType_FromModuleAndSpec(m, &GrpcCore_spec, NULL);
    if (core == NULL || PyModule_AddType(m, core) < 0)
        return -1;
    Py_DECREF(core);
    return 0;
}

static PyModuleDef_Slot grpc_speedups_slots[] = {
    {Py_mod_exec, grpc_speedups_exec},
    {0, NULL},
};

static struct PyModuleDef grpc_speedups_module = {
    PyModuleDef_HEAD_INIT,
    "katsubushi_py._grpc_speedups",
    "Compiled twin of the gRPC fast path; see the comment at the top of _grpc_speedups.c.",
    0,
    NULL,
    grpc_speedups_slots,
};

PyMODINIT_FUNC
PyInit__grpc_speedups(void)
{
    return PyModuleDef_Init(&grpc_speedups_module);
}
