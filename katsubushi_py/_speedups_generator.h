/*
 * GeneratorCore, the bucket of the current millisecond (twin of issuing/bucket.py PyGeneratorCore).
 *
 * Part of katsubushi_py._speedups: included once by _speedups.c, in the order written there (each part
 * uses the types and interned strings of the parts before it); see the comment at the top of _speedups.c
 * for what the twins are and the rule that keeps them identical.
 */

/* ------------------------------------------------------------------------------------------------ */
/* GeneratorCore                                                                                     */

typedef struct {
    PyObject_HEAD
    long long next;   /* next unused ID of the bucket */
    long long stop;   /* one past the bucket's last ID */
    long long end_ns; /* monotonic ns at which the bucket stops being valid; -1: never valid */
    long long last;   /* the generator's _last: offset (ms from the epoch) of the last bucket's millisecond */
    /* The roll (gen_roll): what the generator's last _refill decided with, so that the next
     * millisecond's bucket can be set here as that refill would set it. 0: disarmed (every change
     * of the bucket from Python disarms it; only a completed _refill arms it). */
    int roll;
    int r_shift;        /* layout.time_shift */
    long long r_anchor_mono, r_anchor_off; /* the generator's anchor */
    long long r_worker; /* worker_id << worker_shift */
    long long r_size;   /* IDs a millisecond */
    long long r_limit;  /* the last millisecond the state file (or the layout) allows without a refill */
    long long r_fence;  /* the lease fence, monotonic ns; LLONG_MAX: none */
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

/* The millisecond after the bucket's, set here without Python when the generator's _refill would
 * set it without waiting for anything: a reading ``now`` before the fence, in a millisecond later than
 * the last one handed out and not past the reserved limit. Then the bucket is exactly what _refill's
 * last lines make of that reading (base, size, end cut at the fence) and ``last`` moves to it; in
 * every other case (a clock behind or in the same millisecond, the fence, the state file's next
 * window, a closed or switched generator, a reanchor) it returns 0 and the caller goes to Python,
 * whose _refill decides. Only a finished _refill arms it, with the values it used; the generator
 * disarms it first thing in _refill (so no bucket is set here while a refill waits with the GIL
 * released) and whenever it changes the bucket, the fence or the worker id from Python.
 * The pure twin has no roll: there _refill itself does this step, with the same result.
 * 1 if the bucket was set, 0 if not. Nothing here can overflow: every step is checked. */
static int
gen_roll(GenCore *self, long long now)
{
    long long d, q, ms, base, stop, end, span;
    if (!self->roll || now >= self->r_fence)
        return 0;
    if (__builtin_sub_overflow(now, self->r_anchor_mono, &d))
        return 0;
    q = d / 1000000;
    if (d % 1000000 < 0)
        q -= 1; /* Python's floor division, as _offset_at */
    if (__builtin_add_overflow(self->r_anchor_off, q, &ms))
        return 0;
    if (ms <= self->last || ms > self->r_limit || ms < 0 || (ms >> (63 - self->r_shift)) != 0)
        return 0;
    base = (ms << self->r_shift) | self->r_worker;
    if (__builtin_add_overflow(base, self->r_size, &stop))
        return 0;
    if (__builtin_sub_overflow(ms + 1, self->r_anchor_off, &span) || __builtin_mul_overflow(span, 1000000LL, &span) ||
        __builtin_add_overflow(span, self->r_anchor_mono, &end))
        return 0;
    self->next = base;
    self->stop = stop;
    self->end_ns = end < self->r_fence ? end : self->r_fence;
    self->last = ms;
    return 1;
}

/* 1 if the bucket is valid now and holds at least k IDs (after rolling to a new millisecond if it
 * had ended: gen_roll), 0 if not, -1 on error. _set_bucket keeps 0 <= next <= stop, and every take
 * keeps next <= stop, so stop - next cannot overflow; it is checked all the same, so that no state
 * reachable by a bug can make it undefined. */
static int
gen_has(GenCore *self, long long k)
{
    long long now, left;
    if ((__builtin_sub_overflow(self->stop, self->next, &left) || left < k) && !self->roll)
        return 0;
    if (gen_now(self, &now) < 0)
        return -1;
    /* An injected clock is Python and may have set another bucket meanwhile: count again, so that
     * next + k never passes stop (nor 2**63 - 1) whatever it did. */
    if (!__builtin_sub_overflow(self->stop, self->next, &left) && left >= k && now < self->end_ns)
        return 1;
    if (now < self->end_ns || !gen_roll(self, now))
        return 0; /* the millisecond's IDs used up, or Python must decide */
    return self->stop - self->next >= k;
}

static PyObject *
GenCore_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    GenCore *self = (GenCore *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->next = self->stop = 0;
        self->end_ns = -1;
        self->last = -1;
        self->roll = 0;
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
    self->roll = 0;
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

/* _bucket_end_ns and _last: long long fields Python reads and writes (the closure says which). Writing
 * the bucket's end disarms the roll: whoever moves it from Python decides the next bucket too. */
typedef struct {
    const char *name;
    Py_ssize_t offset;
    int disarms;
} GenField;

static GenField field_end = {"_bucket_end_ns", offsetof(GenCore, end_ns), 1};
static GenField field_last = {"_last", offsetof(GenCore, last), 0};

static PyObject *
GenCore_get_field(GenCore *self, void *closure)
{
    GenField *f = closure;
    return PyLong_FromLongLong(*(long long *)((char *)self + f->offset));
}

static int
GenCore_set_field(GenCore *self, PyObject *value, void *closure)
{
    GenField *f = closure;
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "cannot delete %s", f->name);
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *(long long *)((char *)self + f->offset) = v;
    if (f->disarms)
        self->roll = 0;
    return 0;
}

/* _arm_roll(anchor_mono, anchor_off, time_shift, worker_part, size, limit, fence_ns or None): what
 * the generator's _refill just decided with (see gen_roll). */
static PyObject *
GenCore_arm_roll(GenCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long v[7];
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "_arm_roll(anchor_mono, anchor_off, time_shift, worker_part, size, limit, fence)");
        return NULL;
    }
    for (int i = 0; i < 7; i++) {
        if (i == 6 && args[i] == Py_None) {
            v[i] = LLONG_MAX;
            continue;
        }
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (v[2] < 1 || v[2] > 62 || v[3] < 0 || v[3] >= (1LL << v[2]) || v[4] < 1) {
        PyErr_SetString(PyExc_ValueError, "_arm_roll: time_shift in 1..62, 0 <= worker_part < 2**time_shift, size >= 1");
        return NULL;
    }
    self->r_anchor_mono = v[0];
    self->r_anchor_off = v[1];
    self->r_shift = (int)v[2];
    self->r_worker = v[3];
    self->r_size = v[4];
    self->r_limit = v[5];
    self->r_fence = v[6];
    self->roll = 1;
    Py_RETURN_NONE;
}

static PyObject *
GenCore_disarm_roll(GenCore *self, PyObject *Py_UNUSED(ignored))
{
    self->roll = 0;
    Py_RETURN_NONE;
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
    {"_arm_roll", (PyCFunction)(void (*)(void))GenCore_arm_roll, METH_FASTCALL, NULL},
    {"_disarm_roll", (PyCFunction)GenCore_disarm_roll, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef GenCore_getset[] = {
    {"_bucket_end_ns", (getter)GenCore_get_field, (setter)GenCore_set_field, NULL, &field_end},
    {"_last", (getter)GenCore_get_field, (setter)GenCore_set_field, NULL, &field_last},
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
