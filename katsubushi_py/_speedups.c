/*
 * katsubushi_py._speedups: the compiled twin of the hot path.
 *
 * Small types, each the C twin of a pure-Python class that stays the reference and runs wherever
 * this module is not built or KATSUBUSHI_NO_EXTENSIONS=1 is set:
 *
 *   GeneratorCore  twin of issuing/bucket.py PyGeneratorCore: the current millisecond's unused IDs
 *                  (next .. stop), valid until the monotonic instant end_ns. Taking an ID is a clock
 *                  read, a comparison and an increment, atomic because the GIL is held throughout.
 *                  Anything else (a new millisecond, the fence, the state file, waiting) is the
 *                  Python generator's _refill, reached through _next_id_slow / _next_ids_slow.
 *   Counters       twin of issuing/issuer.py PyCounters: commands and IDs as C integers.
 *   TextCore,      twins of the fast cases of TextConnection.receive and BinaryConnection.receive
 *   BinaryCore     (frontends/fastpath.py PyConnectionCore): complete GET/GETS lines (at most 128
 *                  keys of at most 250 bytes), or GET-family and NOOP packets, whose IDs are all in
 *                  the current bucket. At the first request it does not take (any other command, a
 *                  partial request, a used-up bucket, a held buffer, a command in progress, a
 *                  waiting, held-back or closing connection) it hands the rest to the Python
 *                  _receive_slow, so every byte of behaviour that is not the fast path is Python's;
 *                  once its reply reaches REPLY_BUDGET it holds the rest (backlog), as Python does.
 *   ProtocolCore   twin of daemon/connection.py PyProtocolCore: the asyncio protocol's data_received
 *                  (receive, write the reply, and hand closing or waiting to Python), calling a
 *                  compiled connection's receive directly: a request runs no Python frame.
 *   SocketCore     twin of daemon/sockets.py PySocketCore: a memcached connection's read (one recv,
 *                  handed to data_received) and write (one send; the rest queued in Python), for the
 *                  socket transport the loop drives with add_reader, so that a request passes through
 *                  no event-loop stream object at all. On a TLS connection (_tls: OpenSSL's object of the
 *                  SSLSocket) the read is its read(n) and the write its write(data), and whatever they
 *                  raise is handed to Python (_tls_failed, _tls_write_failed) to decide; where the
 *                  object's SSL can be trusted, SSL_read_ex and SSL_write_ex are called directly
 *                  instead, with read-ahead, and their errors become the same exceptions
 *                  (_tls_direct.h).
 *
 * The rule that keeps the twins identical: C only ever does what the Python code would do for the
 * same input in the same state, and gives up (to Python) whenever it would have to decide anything
 * else. tests/test_speedups.py compares the two byte for byte on generated input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

static PyObject *str_next_id_slow, *str_next_ids_slow, *str_receive_slow;

/* ------------------------------------------------------------------------------------------------ */
/* GeneratorCore                                                                                     */

typedef struct {
    PyObject_HEAD
    long long next;   /* next unused ID of the bucket */
    long long stop;   /* one past the bucket's last ID */
    long long end_ns; /* monotonic ns at which the bucket stops being valid; -1: never valid */
    PyObject *mono_fn; /* NULL: CLOCK_MONOTONIC (what time.monotonic_ns reads); else an injected clock */
    /* The decimal text of the last ID formatted (digits_of; -1: none), so that the next consecutive
     * one is a count up, not 19 divisions. */
    long long digits_of;
    int ndigits;
    char digits[24];
} GenCore;

static int
gen_now(GenCore *self, long long *out)
{
    if (self->mono_fn == NULL) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        *out = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        return 0;
    }
    /* The clock may drop itself (_use_clock(None)) while it runs: hold it for the call. */
    PyObject *fn = self->mono_fn;
    Py_INCREF(fn);
    PyObject *r = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (r == NULL)
        return -1;

    *out = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* 1 if the bucket is valid now and holds at least k IDs, 0 if not, -1 on error. _set_bucket keeps
 * 0 <= next <= stop, and every take keeps next <= stop, so stop - next cannot overflow; it is checked
 * all the same, so that no state reachable by a bug can make it undefined. */
static int
gen_has(GenCore *self, long long k)
{
    long long now, left;
    if (__builtin_sub_overflow(self->stop, self->next, &left) || left < k)
        return 0;
    if (gen_now(self, &now) < 0)
        return -1;
    /* An injected clock is Python and may have set another bucket meanwhile: count again, so that
     * next + k never passes stop (nor 2**63 - 1) whatever it did. */
    if (__builtin_sub_overflow(self->stop, self->next, &left) || left < k)
        return 0;
    return now < self->end_ns;
}

static PyObject *
GenCore_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    GenCore *self = (GenCore *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->next = self->stop = 0;
        self->end_ns = -1;
        self->mono_fn = NULL;
        self->digits_of = -1;
    }
    return (PyObject *)self;
}

static int
GenCore_traverse(GenCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->mono_fn);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
GenCore_clear(GenCore *self)
{
    Py_CLEAR(self->mono_fn);
    return 0;
}

static void
GenCore_dealloc(GenCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GenCore_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
GenCore_next_id(GenCore *self, PyObject *Py_UNUSED(ignored))
{
    int has = gen_has(self, 1);
    if (has < 0)
        return NULL;
    if (has)
        return PyLong_FromLongLong(self->next++);
    return PyObject_CallMethodNoArgs((PyObject *)self, str_next_id_slow);
}

static PyObject *
GenCore_next_ids(GenCore *self, PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0)
        return PyList_New(0);
    int has = gen_has(self, n);
    if (has < 0)
        return NULL;
    if (!has)
        return PyObject_CallMethodOneArg((PyObject *)self, str_next_ids_slow, arg);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(self->next + i);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, v);
    }
    self->next += n;
    return list;
}

static PyObject *
GenCore_take(GenCore *self, PyObject *Py_UNUSED(ignored))
{
    if (self->next < self->stop)
        return PyLong_FromLongLong(self->next++);
    Py_RETURN_NONE;
}

static PyObject *
GenCore_take_many(GenCore *self, PyObject *arg)
{
    long long k = PyLong_AsLongLong(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    long long left;
    if (__builtin_sub_overflow(self->stop, self->next, &left) || left < 0)
        left = 0;
    if (k > left)
        k = left;
    if (k < 0)
        k = 0;
    PyObject *list = PyList_New((Py_ssize_t)k);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *v = PyLong_FromLongLong(self->next + i);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, v);
    }
    self->next += k;
    return list;
}

static PyObject *
GenCore_set_bucket(GenCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long base, count, end;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_set_bucket(base, count, end_ns)");
        return NULL;
    }
    base = PyLong_AsLongLong(args[0]);
    count = PyLong_AsLongLong(args[1]);
    end = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    long long stop;
    if (base < 0 || count < 0 || __builtin_add_overflow(base, count, &stop)) {
        PyErr_SetString(PyExc_ValueError, "_set_bucket: base and count must be >= 0 and base + count < 2**63");
        return NULL;
    }
    /* Order matters for nothing here: the GIL is held, no other thread sees a half-set bucket. */
    self->next = base;
    self->stop = stop;
    self->end_ns = end;
    Py_RETURN_NONE;
}

static PyObject *
GenCore_drop_bucket(GenCore *self, PyObject *Py_UNUSED(ignored))
{
    self->next = self->stop = 0;
    self->end_ns = -1;
    Py_RETURN_NONE;
}

static PyObject *
GenCore_bucket_left(GenCore *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(self->stop > self->next ? self->stop - self->next : 0);
}

static PyObject *
GenCore_use_clock(GenCore *self, PyObject *fn)
{
    if (fn == Py_None) {
        Py_CLEAR(self->mono_fn);
    } else {
        Py_INCREF(fn);
        Py_XSETREF(self->mono_fn, fn);
    }
    Py_RETURN_NONE;
}

static PyObject *
GenCore_get_end(GenCore *self, void *closure)
{
    return PyLong_FromLongLong(self->end_ns);
}

static int
GenCore_set_end(GenCore *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete _bucket_end_ns");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    self->end_ns = v;
    return 0;
}

static PyMethodDef GenCore_methods[] = {
    {"next_id", (PyCFunction)GenCore_next_id, METH_NOARGS, "One ID, greater than every ID issued before."},
    {"next_ids", (PyCFunction)GenCore_next_ids, METH_O, "n increasing IDs."},
    {"_take", (PyCFunction)GenCore_take, METH_NOARGS, NULL},
    {"_take_many", (PyCFunction)GenCore_take_many, METH_O, NULL},
    {"_set_bucket", (PyCFunction)(void (*)(void))GenCore_set_bucket, METH_FASTCALL, NULL},
    {"_drop_bucket", (PyCFunction)GenCore_drop_bucket, METH_NOARGS, NULL},
    {"_bucket_left", (PyCFunction)GenCore_bucket_left, METH_NOARGS, NULL},
    {"_use_clock", (PyCFunction)GenCore_use_clock, METH_O, NULL},
    {NULL},
};

static PyGetSetDef GenCore_getset[] = {
    {"_bucket_end_ns", (getter)GenCore_get_end, (setter)GenCore_set_end, NULL, NULL},
    {NULL},
};

static PyType_Slot GenCore_slots[] = {
    {Py_tp_new, GenCore_new},
    {Py_tp_dealloc, GenCore_dealloc},
    {Py_tp_traverse, GenCore_traverse},
    {Py_tp_clear, GenCore_clear},
    {Py_tp_methods, GenCore_methods},
    {Py_tp_getset, GenCore_getset},
    {Py_tp_doc, "The generator's bucket and fast path (compiled twin of PyGeneratorCore)."},
    {0, NULL},
};

static PyType_Spec GenCore_spec = {
    "katsubushi_py._speedups.GeneratorCore",
    sizeof(GenCore),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    GenCore_slots,
};

/* ------------------------------------------------------------------------------------------------ */
/* Counters                                                                                          */

typedef struct {
    PyObject_HEAD
    long long commands;
    long long ids;
    PyObject *failures; /* dict: reason -> count */
    PyObject *protocol; /* str */
} Counters;

static PyObject *
Counters_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"protocol", NULL};
    PyObject *protocol;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "U", kwlist, &protocol))
        return NULL;
    Counters *self = (Counters *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->failures = PyDict_New();
    if (self->failures == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(protocol);
    self->protocol = protocol;
    return (PyObject *)self;
}

static int
Counters_init(PyObject *self, PyObject *args, PyObject *kwds)
{
    return 0; /* everything is done in tp_new */
}

static int
Counters_traverse(Counters *self, visitproc visit, void *arg)
{
    Py_VISIT(self->failures);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
Counters_clear(Counters *self)
{
    Py_CLEAR(self->failures);
    Py_CLEAR(self->protocol);
    return 0;
}

static void
Counters_dealloc(Counters *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Counters_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef Counters_members[] = {
    {"commands", T_LONGLONG, offsetof(Counters, commands), 0, "requests for IDs"},
    {"ids", T_LONGLONG, offsetof(Counters, ids), 0, "IDs issued"},
    {"failures", T_OBJECT_EX, offsetof(Counters, failures), 0, "requests that got no IDs, by reason"},
    {"protocol", T_OBJECT_EX, offsetof(Counters, protocol), READONLY, "the protocol counted"},
    {NULL},
};

static PyType_Slot Counters_slots[] = {
    {Py_tp_new, Counters_new},
    {Py_tp_init, Counters_init},
    {Py_tp_dealloc, Counters_dealloc},
    {Py_tp_traverse, Counters_traverse},
    {Py_tp_clear, Counters_clear},
    {Py_tp_members, Counters_members},
    {Py_tp_doc, "One protocol's counters (compiled twin of PyCounters)."},
    {0, NULL},
};

static PyType_Spec Counters_spec = {
    "katsubushi_py._speedups.Counters",
    sizeof(Counters),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Counters_slots,
};

/* ------------------------------------------------------------------------------------------------ */
/* Connection cores: TextCore and BinaryCore share one layout                                                                                          */

/* The limits shared with frontends/fastpath.py (exported, and compared by a test). */
#define MAX_FAST_KEYS 128   /* GET_BATCH: the longest get line the fast path takes */
#define MAX_KEY 250         /* memcached's key limit */
#define REPLY_BUDGET 65536  /* a receive takes no further command once its reply is this long */

typedef struct ConnCore_ {
    PyObject_HEAD
    /* The sans-IO connection's own state, shared with the Python subclass as attributes. */
    PyObject *buffer;    /* _buffer: bytes held from earlier reads */
    int state;           /* _state: 0 at a command's start; else in the middle of one (Python's) */
    char closing;        /* closing */
    char backlog;        /* backlog: input held until the reply so far is written (resume) */
    double wait;         /* wait */
    long long activity;  /* activity */
    Py_ssize_t spent;    /* _spent: reply bytes made before handing the rest to _receive_slow */
    /* Set once by _fast_init. */
    GenCore *gen;        /* NULL: no fast path */
    Counters *counters;
    Py_ssize_t max_line;
    char gets_fast;      /* GETS is answered exactly like GET (no --gets-cas) */
    PyObject *(*receive)(struct ConnCore_ *, PyObject *); /* this protocol's receive, for ProtocolCore */
} ConnCore;

static PyTypeObject *GenCore_Type, *Counters_Type, *TextCore_Type, *BinaryCore_Type;
static PyObject *TextCore_receive(ConnCore *self, PyObject *data);
static PyObject *BinaryCore_receive(ConnCore *self, PyObject *data);

static PyObject *
ConnCore_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    ConnCore *self = (ConnCore *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->buffer = PyBytes_FromStringAndSize(NULL, 0);
        if (self->buffer == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        self->max_line = 0;
        self->receive = PyType_IsSubtype(type, BinaryCore_Type) ? BinaryCore_receive : TextCore_receive;
    }
    return (PyObject *)self;
}

static int
ConnCore_traverse(ConnCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->gen);
    Py_VISIT(self->counters);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
ConnCore_clear(ConnCore *self)
{
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->gen);
    Py_CLEAR(self->counters);
    return 0;
}

static void
ConnCore_dealloc(ConnCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ConnCore_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* _fast_init(generator, counters, max_line=0, gets_fast=False): the fast path is used only when the
 * generator and the counters are the compiled types. */
static PyObject *
ConnCore_fast_init(ConnCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "_fast_init(generator, counters[, max_line, gets_fast])");
        return NULL;
    }
    Py_CLEAR(self->gen);
    Py_CLEAR(self->counters);
    if (PyObject_TypeCheck(args[0], GenCore_Type) && PyObject_TypeCheck(args[1], Counters_Type)) {
        Py_INCREF(args[0]);
        self->gen = (GenCore *)args[0];
        Py_INCREF(args[1]);
        self->counters = (Counters *)args[1];
    }
    if (nargs == 4) {
        self->max_line = PyLong_AsSsize_t(args[2]);
        if (self->max_line == -1 && PyErr_Occurred())
            return NULL;
        int gets_fast = PyObject_IsTrue(args[3]);
        if (gets_fast < 0)
            return NULL;
        self->gets_fast = (char)gets_fast;
    }
    Py_RETURN_NONE;
}

/* bytes.split()'s whitespace: space, \t, \n, \r, \v, \f */
static inline int
is_ws(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* Digits of v (>= 0) into out, returns the count. */
static inline int
put_digits(char *out, unsigned long long v)
{
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (int i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    return n;
}

/* The decimal text of ID id into gen->digits (returns its length): a count up from the last one
 * formatted when id follows it, else formatted afresh. */
static inline int
gen_digits(GenCore *gen, long long id)
{
    if (gen->digits_of >= 0 && id - gen->digits_of == 1) { /* both >= 0: no overflow */
        int d = gen->ndigits - 1;
        while (d >= 0 && gen->digits[d] == '9')
            gen->digits[d--] = '0';
        if (d >= 0) {
            gen->digits[d]++;
            gen->digits_of = id;
            return gen->ndigits;
        }
    } else if (id == gen->digits_of) {
        return gen->ndigits;
    }
    gen->ndigits = put_digits(gen->digits, (unsigned long long)id);
    gen->digits_of = id;
    return gen->ndigits;
}

typedef struct {
    char *data;
    Py_ssize_t len, cap;
    char stack[2048];
} outbuf;

static int
out_reserve(outbuf *o, Py_ssize_t more)
{
    if (o->len + more <= o->cap)
        return 0;
    Py_ssize_t cap = o->cap * 2;
    while (cap < o->len + more)
        cap *= 2;
    char *p;
    if (o->data == o->stack) {
        p = PyMem_Malloc(cap);
        if (p != NULL)
            memcpy(p, o->stack, o->len);
    } else {
        p = PyMem_Realloc(o->data, cap);
    }
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->data = p;
    o->cap = cap;
    return 0;
}

static void
out_free(outbuf *o)
{
    if (o->data != o->stack)
        PyMem_Free(o->data);
}

/* " 0 <length>\r\n" after a VALUE line's key, by the length of the ID (1 to 20 digits), padded to 8
 * bytes so that one fixed-size copy writes it (the next write overwrites the padding). */
static const char FLAGS_LENGTH[21][8] = {
    "",          " 0 1\r\n",  " 0 2\r\n",  " 0 3\r\n",  " 0 4\r\n",  " 0 5\r\n",  " 0 6\r\n",
    " 0 7\r\n",  " 0 8\r\n",  " 0 9\r\n",  " 0 10\r\n", " 0 11\r\n", " 0 12\r\n", " 0 13\r\n",
    " 0 14\r\n", " 0 15\r\n", " 0 16\r\n", " 0 17\r\n", " 0 18\r\n", " 0 19\r\n", " 0 20\r\n",
};

/* Try to answer one line [p, end) (without its LF) as a GET the fast path may take. Returns 1 if
 * answered (reply appended), 0 if the line is for Python, -1 on error. */
static int
text_fast_line(ConnCore *self, GenCore *gen, Counters *counters, const char *p, const char *end, outbuf *out)
{
    const char *keys[MAX_FAST_KEYS];
    Py_ssize_t keylen[MAX_FAST_KEYS];
    Py_ssize_t total = 0; /* bytes of all the keys */
    int nkeys = 0;

    while (p < end && is_ws((unsigned char)*p))
        p++;
    const char *w = p;
    while (p < end && !is_ws((unsigned char)*p))
        p++;
    Py_ssize_t wl = p - w;
    if (wl == 3) {
        if (!((w[0] | 0x20) == 'g' && (w[1] | 0x20) == 'e' && (w[2] | 0x20) == 't'))
            return 0;
    } else if (wl == 4 && self->gets_fast) {
        if (!((w[0] | 0x20) == 'g' && (w[1] | 0x20) == 'e' && (w[2] | 0x20) == 't' && (w[3] | 0x20) == 's'))
            return 0;
    } else {
        return 0;
    }
    /* Case-insensitive ('|0x20' maps only 'G'/'g', 'E'/'e', ... onto these letters): Python looks up
     * other spellings lower-cased, so it answers them the same way. */
    for (;;) {
        while (p < end && is_ws((unsigned char)*p))
            p++;
        if (p >= end)
            break;
        if (nkeys == MAX_FAST_KEYS)
            return 0;
        keys[nkeys] = p;
        while (p < end && !is_ws((unsigned char)*p))
            p++;
        keylen[nkeys] = p - keys[nkeys];
        if (keylen[nkeys] > MAX_KEY)
            return 0; /* CLIENT_ERROR in its place: Python's */
        total += keylen[nkeys];
        nkeys++;
    }
    if (nkeys == 0)
        return 0; /* "GET" alone: ERROR, Python's */
    int has = gen_has(gen, nkeys);
    if (has <= 0)
        return has; /* used up or expired: Python refills (and may wait or fail) */
    if (out_reserve(out, 8 + total + 48 * (Py_ssize_t)nkeys) < 0) /* each key's line and value, END */
        return -1;
    char *o = out->data + out->len;
    long long id = gen->next;
    for (int i = 0; i < nkeys; i++, id++) {
        int nd = gen_digits(gen, id);
        const char *digits = gen->digits;
        memcpy(o, "VALUE ", 6);
        o += 6;
        memcpy(o, keys[i], keylen[i]);
        o += keylen[i];
        memcpy(o, FLAGS_LENGTH[nd], 8); /* " 0 <nd>\r\n" and padding, then only its length kept */
        o += nd < 10 ? 6 : 7;
        memcpy(o, digits, nd);
        o += nd;
        *o++ = '\r';
        *o++ = '\n';
    }
    memcpy(o, "END\r\n", 5);
    o += 5;
    out->len = o - out->data;
    gen->next += nkeys;
    counters->commands += 1;
    counters->ids += nkeys;
    self->activity += 1;
    return 1;
}

/* The reply to data when the fast path answered data[0:pos] into out: out alone if it took
 * everything; if it stopped because out reached the reply budget, out, with the rest held (backlog),
 * as Python holds it at that point; else out followed by what the Python _receive_slow answers for the
 * rest, told how much out already holds (_spent) so that it stops where it would have alone. */
static PyObject *
finish_reply(ConnCore *self, PyObject *data, Py_ssize_t pos, outbuf *out, int over_budget)
{
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    if (pos == len)
        return PyBytes_FromStringAndSize(out->data, out->len);
    PyObject *rest = pos == 0 ? Py_NewRef(data) : PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + pos, len - pos);
    if (rest == NULL)
        return NULL;
    if (over_budget) {
        Py_SETREF(self->buffer, rest);
        self->backlog = 1;
        return PyBytes_FromStringAndSize(out->data, out->len);
    }
    self->spent = out->len;
    PyObject *tail = PyObject_CallMethodOneArg((PyObject *)self, str_receive_slow, rest);
    self->spent = 0;
    Py_DECREF(rest);
    if (tail == NULL || out->len == 0)
        return tail;
    if (!PyBytes_Check(tail)) {
        Py_DECREF(tail);
        PyErr_SetString(PyExc_TypeError, "_receive_slow must return bytes");
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, out->len + PyBytes_GET_SIZE(tail));
    if (result != NULL) {
        memcpy(PyBytes_AS_STRING(result), out->data, out->len);
        memcpy(PyBytes_AS_STRING(result) + out->len, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail));
    }
    Py_DECREF(tail);
    return result;
}

/* May the fast path look at data at all? Not before _fast_init found compiled parts, and not while
 * the connection holds bytes, is in the middle of a command (a get line's keys, a data block), waits
 * for the clock or for its reply to be written, or is closing: those are Python's to handle. */
static inline int
may_take(ConnCore *self, PyObject *data)
{
    return self->gen != NULL && PyBytes_CheckExact(data) && !self->closing && self->wait == 0.0 &&
           self->state == 0 && !self->backlog && PyBytes_GET_SIZE(self->buffer) == 0;
}

static PyObject *
TextCore_receive(ConnCore *self, PyObject *data)
{
    if (!may_take(self, data))
        return PyObject_CallMethodOneArg((PyObject *)self, str_receive_slow, data);
    const char *start = PyBytes_AS_STRING(data);
    const char *pos = start, *end = start + PyBytes_GET_SIZE(data);
    outbuf out;
    out.data = out.stack;
    out.len = 0;
    out.cap = sizeof(out.stack);
    int over_budget = 0;
    /* The generator's clock may be Python (an injected one) and do anything, _fast_init included:
     * hold the generator and the counters while they are used. */
    GenCore *gen = self->gen;
    Counters *counters = self->counters;
    Py_INCREF(gen);
    Py_INCREF(counters);
    while (pos < end) {
        if (out.len >= REPLY_BUDGET) {
            over_budget = 1;
            break;
        }
        const char *nl = memchr(pos, '\n', end - pos);
        if (nl == NULL || nl - pos >= self->max_line)
            break;
        int r = text_fast_line(self, gen, counters, pos, nl, &out);
        if (r < 0) {
            out_free(&out);
            Py_DECREF(gen);
            Py_DECREF(counters);
            return NULL;
        }
        if (r == 0)
            break;
        pos = nl + 1;
    }
    Py_DECREF(gen);
    Py_DECREF(counters);
    PyObject *result = finish_reply(self, data, pos - start, &out, over_budget);
    out_free(&out);
    return result;
}

/* The binary protocol: the request and response headers are 24 bytes, big-endian. */
#define BIN_HEADER 24
#define BIN_MAX_KEY MAX_KEY
#define BIN_MAX_BODY 4096
#define OP_GET 0x00
#define OP_GETQ 0x09
#define OP_NOOP 0x0a
#define OP_GETK 0x0c
#define OP_GETKQ 0x0d

static inline unsigned int
be16(const unsigned char *p)
{
    return ((unsigned int)p[0] << 8) | p[1];
}

static inline unsigned long
be32(const unsigned char *p)
{
    return ((unsigned long)p[0] << 24) | ((unsigned long)p[1] << 16) | ((unsigned long)p[2] << 8) | p[3];
}

/* A response header: magic 0x81, the request's opcode and opaque, status 0, CAS 0. */
static inline char *
bin_header(char *o, int opcode, unsigned int keylen, int extlen, unsigned long bodylen, const unsigned char *opaque)
{
    unsigned char *u = (unsigned char *)o;
    u[0] = 0x81;
    u[1] = (unsigned char)opcode;
    u[2] = (unsigned char)(keylen >> 8);
    u[3] = (unsigned char)keylen;
    u[4] = (unsigned char)extlen;
    u[5] = 0;
    u[6] = u[7] = 0;
    u[8] = (unsigned char)(bodylen >> 24);
    u[9] = (unsigned char)(bodylen >> 16);
    u[10] = (unsigned char)(bodylen >> 8);
    u[11] = (unsigned char)bodylen;
    memcpy(u + 12, opaque, 4);
    memset(u + 16, 0, 8);
    return o + BIN_HEADER;
}

static PyObject *
BinaryCore_receive(ConnCore *self, PyObject *data)
{
    if (!may_take(self, data))
        return PyObject_CallMethodOneArg((PyObject *)self, str_receive_slow, data);
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data), pos = 0;
    outbuf out;
    out.data = out.stack;
    out.len = 0;
    out.cap = sizeof(out.stack);
    int over_budget = 0;
    /* Held while used: the generator's clock may be Python and do anything (see TextCore_receive). */
    GenCore *gen = self->gen;
    Counters *counters = self->counters;
    Py_INCREF(gen);
    Py_INCREF(counters);
    while (len - pos >= BIN_HEADER) {
        const unsigned char *h = p + pos;
        int opcode = h[1];
        unsigned int keylen = be16(h + 2);
        int extlen = h[4];
        unsigned long bodylen = be32(h + 8);
        if (h[0] != 0x80 || keylen > BIN_MAX_KEY || bodylen > BIN_MAX_BODY || keylen + extlen > bodylen ||
            pos + BIN_HEADER + (Py_ssize_t)bodylen > len)
            break; /* a bad or incomplete request: Python's */
        if (opcode == OP_NOOP) {
            /* Python stops before any request but a get once the reply has reached the budget. */
            if (out.len >= REPLY_BUDGET) {
                over_budget = 1;
                break;
            }
            if (out_reserve(&out, BIN_HEADER) < 0)
                goto error;
            bin_header(out.data + out.len, OP_NOOP, 0, 0, 0, h + 12);
            out.len += BIN_HEADER;
            self->activity += 1;
        } else if (opcode == OP_GET || opcode == OP_GETQ || opcode == OP_GETK || opcode == OP_GETKQ) {
            int has = gen_has(gen, 1);
            if (has < 0)
                goto error;
            if (!has)
                break; /* used up or expired: Python refills (and may wait or fail) */
            unsigned int klen = (opcode == OP_GETK || opcode == OP_GETKQ) ? keylen : 0;
            if (out_reserve(&out, BIN_HEADER + 4 + klen + 24) < 0)
                goto error;
            long long id = gen->next++;
            int nd = gen_digits(gen, id);
            char *o = bin_header(out.data + out.len, opcode, klen, 4, 4 + klen + nd, h + 12);
            memset(o, 0, 4);
            o += 4;
            memcpy(o, h + BIN_HEADER + extlen, klen);
            o += klen;
            memcpy(o, gen->digits, nd);
            o += nd;
            out.len = o - out.data;
            counters->commands += 1;
            counters->ids += 1;
            self->activity += 1;
        } else {
            break; /* any other command: Python's */
        }
        pos += BIN_HEADER + (Py_ssize_t)bodylen;
    }
    Py_DECREF(gen);
    Py_DECREF(counters);
    PyObject *result = finish_reply(self, data, pos, &out, over_budget);
    out_free(&out);
    return result;
error:
    Py_DECREF(gen);
    Py_DECREF(counters);
    out_free(&out);
    return NULL;
}

static PyObject *
ConnCore_get_buffer(ConnCore *self, void *closure)
{
    Py_INCREF(self->buffer);
    return self->buffer;
}

static int
ConnCore_set_buffer(ConnCore *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyBytes_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "_buffer must be bytes");
        return -1;
    }
    Py_INCREF(value);
    Py_SETREF(self->buffer, value);
    return 0;
}

static PyObject *
ConnCore_get_closing(ConnCore *self, void *closure)
{
    return PyBool_FromLong(self->closing);
}

static int
ConnCore_set_closing(ConnCore *self, PyObject *value, void *closure)
{
    int v = value == NULL ? -1 : PyObject_IsTrue(value);
    if (v < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "cannot delete closing");
        return -1;
    }
    self->closing = (char)v;
    return 0;
}

static PyObject *
ConnCore_get_backlog(ConnCore *self, void *closure)
{
    return PyBool_FromLong(self->backlog);
}

static int
ConnCore_set_backlog(ConnCore *self, PyObject *value, void *closure)
{
    int v = value == NULL ? -1 : PyObject_IsTrue(value);
    if (v < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "cannot delete backlog");
        return -1;
    }
    self->backlog = (char)v;
    return 0;
}

static PyMethodDef TextCore_methods[] = {
    {"receive", (PyCFunction)TextCore_receive, METH_O, "Take newly arrived bytes; return the reply."},
    {"_fast_init", (PyCFunction)(void (*)(void))ConnCore_fast_init, METH_FASTCALL, NULL},
    {NULL},
};

static PyMemberDef ConnCore_members[] = {
    {"wait", T_DOUBLE, offsetof(ConnCore, wait), 0, NULL},
    {"activity", T_LONGLONG, offsetof(ConnCore, activity), 0, NULL},
    {"_state", T_INT, offsetof(ConnCore, state), 0, NULL},
    {"_spent", T_PYSSIZET, offsetof(ConnCore, spent), READONLY, NULL},
    {NULL},
};

static PyGetSetDef ConnCore_getset[] = {
    {"_buffer", (getter)ConnCore_get_buffer, (setter)ConnCore_set_buffer, NULL, NULL},
    {"closing", (getter)ConnCore_get_closing, (setter)ConnCore_set_closing, NULL, NULL},
    {"backlog", (getter)ConnCore_get_backlog, (setter)ConnCore_set_backlog, NULL, NULL},
    {NULL},
};

static PyType_Slot TextCore_slots[] = {
    {Py_tp_new, ConnCore_new},
    {Py_tp_dealloc, ConnCore_dealloc},
    {Py_tp_traverse, ConnCore_traverse},
    {Py_tp_clear, ConnCore_clear},
    {Py_tp_methods, TextCore_methods},
    {Py_tp_members, ConnCore_members},
    {Py_tp_getset, ConnCore_getset},
    {Py_tp_doc, "Fast cases of the memcached text protocol (compiled twin of PyConnectionCore)."},
    {0, NULL},
};

static PyType_Spec TextCore_spec = {
    "katsubushi_py._speedups.TextCore",
    sizeof(ConnCore),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    TextCore_slots,
};

static PyMethodDef BinaryCore_methods[] = {
    {"receive", (PyCFunction)BinaryCore_receive, METH_O, "Take newly arrived bytes; return the reply."},
    {"_fast_init", (PyCFunction)(void (*)(void))ConnCore_fast_init, METH_FASTCALL, NULL},
    {NULL},
};

static PyType_Slot BinaryCore_slots[] = {
    {Py_tp_new, ConnCore_new},
    {Py_tp_dealloc, ConnCore_dealloc},
    {Py_tp_traverse, ConnCore_traverse},
    {Py_tp_clear, ConnCore_clear},
    {Py_tp_methods, BinaryCore_methods},
    {Py_tp_members, ConnCore_members},
    {Py_tp_getset, ConnCore_getset},
    {Py_tp_doc, "Fast cases of the memcached binary protocol (compiled twin of PyConnectionCore)."},
    {0, NULL},
};

static PyType_Spec BinaryCore_spec = {
    "katsubushi_py._speedups.BinaryCore",
    sizeof(ConnCore),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    BinaryCore_slots,
};

/* ------------------------------------------------------------------------------------------------ */
/* ProtocolCore: the asyncio protocol's data_received, twin of daemon/connection.py PyProtocolCore    */

typedef struct {
    PyObject_HEAD
    PyObject *conn;    /* _conn: the sans-IO connection */
    PyObject *receive; /* _receive: what takes the bytes (conn.receive, or the first-read sniffer) */
    PyObject *write;   /* _write: transport.write */
    ConnCore *fast;    /* the connection when it is a compiled core and _use() bound it: called directly */
} ProtoCore;

static PyObject *str_after_receive, *str_closing, *str_wait, *str_backlog;

/* A connection that is not a compiled core (gRPC's, the first-read sniffer's): does its state ask for
 * nothing after the write (not closing, not waiting, nothing held back)? The pure twin's
 * ``conn.closing or conn.wait or conn.backlog``, read from the connection bound now (a receive may
 * have bound another), without a Python frame for the common answer. 1 yes, 0 no, -1 error. */
static int
ProtoCore_conn_is_quiet(PyObject *conn)
{
    if (conn == NULL)
        return 0; /* closed meanwhile: let _after_receive decide */
    PyObject *names[3] = {str_closing, str_wait, str_backlog};
    Py_INCREF(conn);
    int quiet = 1;
    for (int i = 0; i < 3 && quiet == 1; i++) {
        PyObject *v = PyObject_GetAttr(conn, names[i]);
        if (v == NULL) {
            quiet = -1;
            break;
        }
        int t = PyObject_IsTrue(v);
        Py_DECREF(v);
        quiet = t < 0 ? -1 : !t;
    }
    Py_DECREF(conn);
    return quiet;
}

static int
ProtoCore_traverse(ProtoCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->conn);
    Py_VISIT(self->receive);
    Py_VISIT(self->write);
    Py_VISIT(self->fast);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
ProtoCore_clear(ProtoCore *self)
{
    Py_CLEAR(self->conn);
    Py_CLEAR(self->receive);
    Py_CLEAR(self->write);
    Py_CLEAR(self->fast);
    return 0;
}

static void
ProtoCore_dealloc(ProtoCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ProtoCore_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* data_received(data): the reply to what arrived, written at once; anything else a connection may
 * need afterwards (close, wait for the clock, carry on once the reply is written) is the Python
 * _after_receive's, called only when the connection's state asks for it (as the pure twin does).
 *
 * Every call into Python here can drop what this function is using: a receive that closes the
 * connection resets _conn and _receive, a write that fails makes the transport drop _write. So each
 * object is held for as long as it is used, and the protocol itself (self) for the whole call. */
static PyObject *
ProtoCore_data_received(ProtoCore *self, PyObject *data)
{
    PyObject *reply, *result = NULL;
    ConnCore *fast = self->fast;
    Py_INCREF(self);
    if (fast != NULL) {
        Py_INCREF(fast);
        reply = fast->receive(fast, data);
    } else if (self->receive != NULL) {
        PyObject *receive = Py_NewRef(self->receive);
        reply = PyObject_CallOneArg(receive, data);
        Py_DECREF(receive);
    } else {
        Py_DECREF(self);
        Py_RETURN_NONE; /* not connected (yet, or any more) */
    }
    if (reply == NULL)
        goto done;
    if (!PyBytes_Check(reply) || PyBytes_GET_SIZE(reply) != 0) {
        if (self->write == NULL) {
            Py_DECREF(reply);
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *write = Py_NewRef(self->write);
        PyObject *r = PyObject_CallOneArg(write, reply);
        Py_DECREF(write);
        Py_DECREF(reply);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    } else {
        Py_DECREF(reply);
    }
    int quiet;
    if (fast != NULL)
        quiet = !fast->closing && fast->wait == 0.0 && !fast->backlog;
    else
        quiet = ProtoCore_conn_is_quiet(self->conn);
    if (quiet < 0)
        goto done;
    if (quiet)
        result = Py_NewRef(Py_None);
    else
        result = PyObject_CallMethodNoArgs((PyObject *)self, str_after_receive);
done:
    Py_XDECREF(fast);
    Py_DECREF(self);
    return result;
}

/* _use(conn): from now on hand every read to conn.receive; directly in C when conn is a compiled core.
 * Everything is looked up first (lookups may run Python code), then the three slots are set. */
static PyObject *
ProtoCore_use(ProtoCore *self, PyObject *conn)
{
    PyObject *receive = PyObject_GetAttrString(conn, "receive");
    if (receive == NULL)
        return NULL;
    ConnCore *fast = NULL;
    if (PyObject_TypeCheck(conn, TextCore_Type) || PyObject_TypeCheck(conn, BinaryCore_Type)) {
        PyObject *meth = PyObject_GetAttrString((PyObject *)Py_TYPE(conn), "receive");
        if (meth == NULL) {
            Py_DECREF(receive);
            return NULL;
        }
        /* Only when the class's receive is the compiled one (a method descriptor of the core). */
        if (Py_IS_TYPE(meth, &PyMethodDescr_Type))
            fast = (ConnCore *)conn;
        Py_DECREF(meth);
    }
    Py_INCREF(conn);
    Py_XINCREF(fast);
    PyObject *old_conn = self->conn, *old_receive = self->receive;
    ConnCore *old_fast = self->fast;
    self->conn = conn;
    self->receive = receive;
    self->fast = fast;
    Py_XDECREF(old_conn);
    Py_XDECREF(old_receive);
    Py_XDECREF(old_fast);
    Py_RETURN_NONE;
}

static PyObject *
ProtoCore_get(PyObject **slot)
{
    PyObject *v = *slot ? *slot : Py_None;
    Py_INCREF(v);
    return v;
}

static int
ProtoCore_set(PyObject **slot, PyObject *value)
{
    PyObject *v = (value == NULL || value == Py_None) ? NULL : value;
    Py_XINCREF(v);
    Py_XSETREF(*slot, v);
    return 0;
}

static PyObject *ProtoCore_get_conn(ProtoCore *self, void *c) { return ProtoCore_get(&self->conn); }
static PyObject *ProtoCore_get_receive(ProtoCore *self, void *c) { return ProtoCore_get(&self->receive); }
static PyObject *ProtoCore_get_write(ProtoCore *self, void *c) { return ProtoCore_get(&self->write); }

/* Setting _conn or _receive by hand (the first-read sniffer, a refused connection) leaves the
 * direct path until _use() binds a connection again. */
static int
ProtoCore_set_conn(ProtoCore *self, PyObject *v, void *c)
{
    Py_CLEAR(self->fast);
    return ProtoCore_set(&self->conn, v);
}

static int
ProtoCore_set_receive(ProtoCore *self, PyObject *v, void *c)
{
    Py_CLEAR(self->fast);
    return ProtoCore_set(&self->receive, v);
}

static int ProtoCore_set_write(ProtoCore *self, PyObject *v, void *c) { return ProtoCore_set(&self->write, v); }

static PyMethodDef ProtoCore_methods[] = {
    {"data_received", (PyCFunction)ProtoCore_data_received, METH_O, "Hand what arrived to the connection; write the reply."},
    {"_use", (PyCFunction)ProtoCore_use, METH_O, NULL},
    {NULL},
};

static PyGetSetDef ProtoCore_getset[] = {
    {"_conn", (getter)ProtoCore_get_conn, (setter)ProtoCore_set_conn, NULL, NULL},
    {"_receive", (getter)ProtoCore_get_receive, (setter)ProtoCore_set_receive, NULL, NULL},
    {"_write", (getter)ProtoCore_get_write, (setter)ProtoCore_set_write, NULL, NULL},
    {NULL},
};

static PyType_Slot ProtoCore_slots[] = {
    {Py_tp_dealloc, ProtoCore_dealloc},
    {Py_tp_traverse, ProtoCore_traverse},
    {Py_tp_clear, ProtoCore_clear},
    {Py_tp_methods, ProtoCore_methods},
    {Py_tp_getset, ProtoCore_getset},
    {Py_tp_doc, "The connection glue's data_received (compiled twin of PyProtocolCore)."},
    {0, NULL},
};

static PyType_Spec ProtoCore_spec = {
    "katsubushi_py._speedups.ProtocolCore",
    sizeof(ProtoCore),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    ProtoCore_slots,
};


/* ------------------------------------------------------------------------------------------------ */
/* SocketCore: twin of daemon/sockets.py PySocketCore, the reading and writing of a socket transport */
/* that the event loop drives with add_reader (no uvloop stream in between).                        */

#include <errno.h>
#include <sys/socket.h>
#include "_tls_direct.h"

typedef struct {
    PyObject_HEAD
    int fd;
    char pending;            /* _pending: bytes wait in the Python queue, so a write must go behind them */
    char closing;            /* _closing: close() or abort() was called: writes are dropped, reads stop */
    PyObject *data_received; /* _data_received: the protocol's data_received */
    PyObject *tls;           /* _tls: OpenSSL's object (read, write, pending) of a TLS connection; NULL: plain */
    char tls_partial;        /* _tls_partial: the last TLS read found part of a record only */
    Py_ssize_t tls_read_size; /* _tls_read_size: what one TLS read asks for */
    SSL *ssl;                /* the SSL of tls when OpenSSL is called directly (_tls_direct.h); else NULL */
} SockCore;

static PyObject *str_queue, *str_eof_received, *str_fatal;
static PyObject *str_read, *str_write, *str_pending, *str_tls_failed, *str_tls_write_failed, *str_tls_more;

/* One read per readiness event (as uvloop's streams do, and of their size), into one buffer shared
 * by every connection of the process: the loop runs one callback at a time. */
#define SOCK_READ_SIZE 262144
static char sock_read_buffer[SOCK_READ_SIZE];

static int
SockCore_traverse(SockCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->data_received);
    Py_VISIT(self->tls);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
SockCore_clear(SockCore *self)
{
    Py_CLEAR(self->data_received);
    self->ssl = NULL;
    Py_CLEAR(self->tls);
    return 0;
}

/* The exception just raised (an OSError of a TLS read or write), handed to the Python method `name`
 * (with `extra`, the data of a write, when not NULL). */
static PyObject *
sock_hand_exception(SockCore *self, PyObject *name, PyObject *extra)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL)
        PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
#endif
    if (exc == NULL)
        return NULL;
    PyObject *r = extra == NULL ? PyObject_CallMethodOneArg((PyObject *)self, name, exc)
                                : PyObject_CallMethodObjArgs((PyObject *)self, name, exc, extra, NULL);
    Py_DECREF(exc);
    return r;
}

/* The TLS read: one read(n) of OpenSSL's object, handed to the protocol; then, if the read got all it
 * asked for, OpenSSL still holds decrypted bytes and the connection goes on, _tls_more (which reads
 * them on the next turn). */
/* The TLS read with OpenSSL called directly (_tls_direct.h): one SSL_read_ex into the read buffer,
 * handed to the protocol. Then, as the connection reads ahead, OpenSSL may hold more (decrypted or
 * not) that the fd will not announce again: _tls_more reads it on the next turn. Want-read is a
 * record begun (the request deadline starts), want-write waits for the fd, the peer's close_notify is
 * end of file; anything else is handed to _tls_failed as the exception the _ssl object raises. */
static PyObject *
sock_tls_direct_readable(SockCore *self)
{
    size_t n = 0;
    size_t want = self->tls_read_size > 0 && self->tls_read_size < SOCK_READ_SIZE ? (size_t)self->tls_read_size
                                                                                 : SOCK_READ_SIZE;
    int ok = tlsd_read_ex(self->ssl, sock_read_buffer, want, &n);
    if (!ok) {
        int err = tlsd_get_error(self->ssl, 0);
        if (err == TLSD_ERROR_WANT_READ) {
            tlsd_err_clear();
            self->tls_partial = 1;
            Py_RETURN_NONE;
        }
        if (err == TLSD_ERROR_WANT_WRITE) {
            tlsd_err_clear();
            Py_RETURN_NONE;
        }
        PyObject *exc = tlsd_exception(err);
        if (exc == NULL)
            return NULL;
        Py_INCREF(self);
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, str_tls_failed, exc);
        Py_DECREF(exc);
        Py_DECREF(self);
        return r;
    }
    PyObject *data = PyBytes_FromStringAndSize(sock_read_buffer, (Py_ssize_t)n);
    if (data == NULL)
        return NULL;
    self->tls_partial = 0;
    Py_INCREF(self);
    PyObject *callback = Py_NewRef(self->data_received);
    PyObject *r = PyObject_CallOneArg(callback, data);
    Py_DECREF(callback);
    Py_DECREF(data);
    if (r != NULL && !self->closing && self->data_received != NULL && self->ssl != NULL &&
        tlsd_has_pending(self->ssl)) {
        Py_DECREF(r);
        r = PyObject_CallMethodNoArgs((PyObject *)self, str_tls_more);
    }
    Py_DECREF(self);
    return r;
}

static PyObject *
sock_tls_readable(SockCore *self)
{
    if (self->ssl != NULL)
        return sock_tls_direct_readable(self);
    PyObject *tls = Py_NewRef(self->tls);
    Py_INCREF(self);
    PyObject *r = NULL;
    PyObject *size = PyLong_FromSsize_t(self->tls_read_size);
    PyObject *data = size == NULL ? NULL : PyObject_CallMethodOneArg(tls, str_read, size);
    Py_XDECREF(size);
    if (data == NULL) {
        if (size != NULL && PyErr_ExceptionMatches(PyExc_OSError))
            r = sock_hand_exception(self, str_tls_failed, NULL);
    } else if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "a TLS read must return bytes");
    } else if (PyBytes_GET_SIZE(data) > 0) {
        self->tls_partial = 0;
        PyObject *callback = Py_NewRef(self->data_received);
        r = PyObject_CallOneArg(callback, data);
        Py_DECREF(callback);
        /* A read that got less than it asked for emptied OpenSSL's record: nothing is pending. */
        if (r != NULL && PyBytes_GET_SIZE(data) == self->tls_read_size && !self->closing &&
            self->data_received != NULL) {
            PyObject *pending = PyObject_CallMethodNoArgs(tls, str_pending);
            int more = pending == NULL ? -1 : PyObject_IsTrue(pending);
            Py_XDECREF(pending);
            if (more != 0) {
                Py_DECREF(r);
                r = more < 0 ? NULL : PyObject_CallMethodNoArgs((PyObject *)self, str_tls_more);
            }
        }
    } else {
        r = PyObject_CallMethodNoArgs((PyObject *)self, str_eof_received);
    }
    Py_XDECREF(data);
    Py_DECREF(tls);
    Py_DECREF(self);
    return r;
}

static void
SockCore_dealloc(SockCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    SockCore_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
sock_fatal(SockCore *self, int err)
{
    PyObject *code = PyLong_FromLong(err);
    if (code == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, str_fatal, code);
    Py_DECREF(code);
    return r;
}

/* _readable(): the loop's reader callback. The protocol's data_received may close the connection,
 * which drops _data_received (and with it perhaps the last reference to the protocol): it is held
 * for the call, and so is this transport. */
static PyObject *
SockCore_readable(SockCore *self, PyObject *unused)
{
    if (self->closing || self->data_received == NULL)
        Py_RETURN_NONE;
    if (self->tls != NULL)
        return sock_tls_readable(self);
    ssize_t n;
    do {
        n = recv(self->fd, sock_read_buffer, SOCK_READ_SIZE, 0);
    } while (n < 0 && errno == EINTR);
    PyObject *r;
    Py_INCREF(self);
    if (n > 0) {
        PyObject *data = PyBytes_FromStringAndSize(sock_read_buffer, n);
        if (data == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        PyObject *callback = Py_NewRef(self->data_received);
        r = PyObject_CallOneArg(callback, data);
        Py_DECREF(callback);
        Py_DECREF(data);
    } else if (n == 0) {
        r = PyObject_CallMethodNoArgs((PyObject *)self, str_eof_received);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        r = Py_NewRef(Py_None);
    } else {
        r = sock_fatal(self, errno);
    }
    Py_DECREF(self);
    return r;
}

/* write(data): send at once when nothing is queued; what the kernel does not take goes to the queue. */
static PyObject *
SockCore_write(SockCore *self, PyObject *data)
{
    if (self->closing)
        Py_RETURN_NONE;
    if (self->pending || !PyBytes_CheckExact(data))
        return PyObject_CallMethodOneArg((PyObject *)self, str_queue, data);
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    if (size == 0)
        Py_RETURN_NONE;
    ssize_t n;
    if (self->ssl != NULL) {
        /* SSL_write_ex directly (_tls_direct.h): all of it, or want-write / want-read, when the same
         * bytes are queued for the retry (as OpenSSL requires), or an error handed to _tls_write_failed
         * as the exception the _ssl object raises. */
        size_t written = 0;
        if (tlsd_write_ex(self->ssl, PyBytes_AS_STRING(data), (size_t)size, &written))
            n = (ssize_t)written;
        else {
            int err = tlsd_get_error(self->ssl, 0);
            if (err == TLSD_ERROR_WANT_WRITE || err == TLSD_ERROR_WANT_READ) {
                tlsd_err_clear();
                return PyObject_CallMethodOneArg((PyObject *)self, str_queue, data);
            }
            PyObject *exc = tlsd_exception(err);
            if (exc == NULL)
                return NULL;
            PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, str_tls_write_failed, exc, data, NULL);
            Py_DECREF(exc);
            return r;
        }
        if (n >= size)
            Py_RETURN_NONE;
    } else if (self->tls != NULL) {
        /* write(data) of OpenSSL's object: all of it, or an exception (SSLWantWriteError: the caller
         * keeps the same bytes for the retry, as OpenSSL requires) handed to _tls_write_failed. */
        PyObject *tls = Py_NewRef(self->tls);
        PyObject *sent = PyObject_CallMethodOneArg(tls, str_write, data);
        Py_DECREF(tls);
        if (sent == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_OSError))
                return NULL;
            return sock_hand_exception(self, str_tls_write_failed, data);
        }
        n = PyLong_AsSsize_t(sent);
        Py_DECREF(sent);
        if (n == -1 && PyErr_Occurred())
            return NULL;
        if (n >= size)
            Py_RETURN_NONE;
        if (n < 0)
            n = 0;
    } else {
        do {
            n = send(self->fd, PyBytes_AS_STRING(data), (size_t)size, MSG_NOSIGNAL | MSG_DONTWAIT);
        } while (n < 0 && errno == EINTR);
    }
    if (n == size)
        Py_RETURN_NONE;
    if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return sock_fatal(self, errno);
        n = 0;
    }
    PyObject *rest = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + n, size - n);
    if (rest == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, str_queue, rest);
    Py_DECREF(rest);
    return r;
}

static PyObject *
SockCore_get_data_received(SockCore *self, void *c)
{
    PyObject *v = self->data_received ? self->data_received : Py_None;
    Py_INCREF(v);
    return v;
}

static int
SockCore_set_data_received(SockCore *self, PyObject *v, void *c)
{
    PyObject *new = (v == NULL || v == Py_None) ? NULL : v;
    Py_XINCREF(new);
    Py_XSETREF(self->data_received, new);
    return 0;
}

static PyObject *
SockCore_get_tls(SockCore *self, void *c)
{
    return Py_NewRef(self->tls ? self->tls : Py_None);
}

/* _tls = OpenSSL's object of the SSLSocket: its SSL is used directly when it can be trusted
 * (_tls_direct.h), and then reads ahead (a record header and body in one read(), or more). */
static int
SockCore_set_tls(SockCore *self, PyObject *v, void *c)
{
    PyObject *new = (v == NULL || v == Py_None) ? NULL : v;
    Py_XINCREF(new);
    self->ssl = NULL;
    Py_XSETREF(self->tls, new);
    if (new != NULL) {
        self->ssl = tlsd_ssl_of(new);
        if (self->ssl != NULL)
            tlsd_set_read_ahead(self->ssl, 1);
    }
    return 0;
}

/* _tls_pending(): whether OpenSSL holds bytes of this connection that the fd will not announce. */
static PyObject *
SockCore_tls_pending(SockCore *self, PyObject *unused)
{
    if (self->ssl != NULL)
        return PyBool_FromLong(tlsd_has_pending(self->ssl));
    if (self->tls == NULL)
        Py_RETURN_FALSE;
    PyObject *pending = PyObject_CallMethodNoArgs(self->tls, str_pending);
    if (pending == NULL)
        return NULL;
    int more = PyObject_IsTrue(pending);
    Py_DECREF(pending);
    if (more < 0)
        return NULL;
    return PyBool_FromLong(more);
}

static PyObject *SockCore_get_tls_direct(SockCore *self, void *c) { return PyBool_FromLong(self->ssl != NULL); }

static PyObject *SockCore_get_pending(SockCore *self, void *c) { return PyBool_FromLong(self->pending); }
static PyObject *SockCore_get_tls_partial(SockCore *self, void *c) { return PyBool_FromLong(self->tls_partial); }
static PyObject *SockCore_get_closing(SockCore *self, void *c) { return PyBool_FromLong(self->closing); }

static int
SockCore_set_flag(char *flag, PyObject *v)
{
    int truth = v == NULL ? 0 : PyObject_IsTrue(v);
    if (truth < 0)
        return -1;
    *flag = (char)truth;
    return 0;
}

static int SockCore_set_pending(SockCore *self, PyObject *v, void *c) { return SockCore_set_flag(&self->pending, v); }
static int SockCore_set_closing(SockCore *self, PyObject *v, void *c) { return SockCore_set_flag(&self->closing, v); }
static int SockCore_set_tls_partial(SockCore *self, PyObject *v, void *c) { return SockCore_set_flag(&self->tls_partial, v); }

static PyMethodDef SockCore_methods[] = {
    {"_readable", (PyCFunction)SockCore_readable, METH_NOARGS, "Read once and hand the bytes to the protocol."},
    {"write", (PyCFunction)SockCore_write, METH_O, "Send now, or queue behind what is queued."},
    {"_tls_pending", (PyCFunction)SockCore_tls_pending, METH_NOARGS, "Does OpenSSL hold bytes the fd will not announce?"},
    {NULL},
};

static PyMemberDef SockCore_members[] = {
    {"_fd", T_INT, offsetof(SockCore, fd), 0, NULL},
    {"_tls_read_size", T_PYSSIZET, offsetof(SockCore, tls_read_size), 0, NULL},
    {NULL},
};

static PyGetSetDef SockCore_getset[] = {
    {"_data_received", (getter)SockCore_get_data_received, (setter)SockCore_set_data_received, NULL, NULL},
    {"_pending", (getter)SockCore_get_pending, (setter)SockCore_set_pending, NULL, NULL},
    {"_closing", (getter)SockCore_get_closing, (setter)SockCore_set_closing, NULL, NULL},
    {"_tls", (getter)SockCore_get_tls, (setter)SockCore_set_tls, NULL, NULL},
    {"_tls_partial", (getter)SockCore_get_tls_partial, (setter)SockCore_set_tls_partial, NULL, NULL},
    {"_tls_direct", (getter)SockCore_get_tls_direct, NULL, "OpenSSL is called directly (_tls_direct.h).", NULL},
    {NULL},
};

static PyType_Slot SockCore_slots[] = {
    {Py_tp_dealloc, SockCore_dealloc},
    {Py_tp_traverse, SockCore_traverse},
    {Py_tp_clear, SockCore_clear},
    {Py_tp_methods, SockCore_methods},
    {Py_tp_members, SockCore_members},
    {Py_tp_getset, SockCore_getset},
    {Py_tp_doc, "A socket transport's read and write (compiled twin of PySocketCore)."},
    {0, NULL},
};

static PyType_Spec SockCore_spec = {
    "katsubushi_py._speedups.SocketCore",
    sizeof(SockCore),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    SockCore_slots,
};

/* ------------------------------------------------------------------------------------------------ */

static int
speedups_exec(PyObject *m)
{
    str_next_id_slow = PyUnicode_InternFromString("_next_id_slow");
    str_next_ids_slow = PyUnicode_InternFromString("_next_ids_slow");
    str_receive_slow = PyUnicode_InternFromString("_receive_slow");
    if (!str_next_id_slow || !str_next_ids_slow || !str_receive_slow)
        return -1;
    GenCore_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &GenCore_spec, NULL);
    if (GenCore_Type == NULL || PyModule_AddType(m, GenCore_Type) < 0)
        return -1;
    Counters_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Counters_spec, NULL);
    if (Counters_Type == NULL || PyModule_AddType(m, Counters_Type) < 0)
        return -1;
    TextCore_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &TextCore_spec, NULL);
    if (TextCore_Type == NULL || PyModule_AddType(m, TextCore_Type) < 0)
        return -1;
    BinaryCore_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &BinaryCore_spec, NULL);
    if (BinaryCore_Type == NULL || PyModule_AddType(m, BinaryCore_Type) < 0)
        return -1;
    str_after_receive = PyUnicode_InternFromString("_after_receive");
    str_closing = PyUnicode_InternFromString("closing");
    str_wait = PyUnicode_InternFromString("wait");
    str_backlog = PyUnicode_InternFromString("backlog");
    if (str_after_receive == NULL || str_closing == NULL || str_wait == NULL || str_backlog == NULL)
        return -1;
    PyTypeObject *proto = (PyTypeObject *)PyType_FromModuleAndSpec(m, &ProtoCore_spec, NULL);
    if (proto == NULL || PyModule_AddType(m, proto) < 0)
        return -1;
    Py_DECREF(proto);
    str_queue = PyUnicode_InternFromString("_queue");
    str_eof_received = PyUnicode_InternFromString("_eof_received");
    str_fatal = PyUnicode_InternFromString("_fatal");
    if (!str_queue || !str_eof_received || !str_fatal)
        return -1;
    str_read = PyUnicode_InternFromString("read");
    str_write = PyUnicode_InternFromString("write");
    str_pending = PyUnicode_InternFromString("pending");
    str_tls_failed = PyUnicode_InternFromString("_tls_failed");
    str_tls_write_failed = PyUnicode_InternFromString("_tls_write_failed");
    str_tls_more = PyUnicode_InternFromString("_tls_more");
    if (!str_read || !str_write || !str_pending || !str_tls_failed || !str_tls_write_failed || !str_tls_more)
        return -1;
    PyTypeObject *sock = (PyTypeObject *)PyType_FromModuleAndSpec(m, &SockCore_spec, NULL);
    if (sock == NULL || PyModule_AddType(m, sock) < 0)
        return -1;
    Py_DECREF(sock);
    if (PyModule_AddIntConstant(m, "MAX_KEY", MAX_KEY) < 0 || PyModule_AddIntConstant(m, "GET_BATCH", MAX_FAST_KEYS) < 0 ||
        PyModule_AddIntConstant(m, "REPLY_BUDGET", REPLY_BUDGET) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BODY", BIN_MAX_BODY) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot speedups_slots[] = {
    {Py_mod_exec, speedups_exec},
    {0, NULL},
};

static PyMethodDef speedups_methods[] = {
    {"tls_direct_setup", (PyCFunction)tls_direct_setup, METH_O,
     "tls_direct_setup(path or None): call OpenSSL of the _ssl module at path directly (see _tls_direct.h)."},
    {NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    "katsubushi_py._speedups",
    "Compiled twin of the hot path; see the comment at the top of _speedups.c.",
    0,
    speedups_methods,
    speedups_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
