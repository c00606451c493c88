/*
 * TextCore and BinaryCore, the fast cases of the text and binary protocols (twins of
 * frontends/fastpath.py PyConnectionCore).
 *
 * Part of katsubushi_py._speedups: included once by _speedups.c, in the order written there (each part
 * uses the types and interned strings of the parts before it); see the comment at the top of _speedups.c
 * for what the twins are and the rule that keeps them identical.
 */

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
