/*
 * Counters, the per-protocol command and ID counters (twin of issuing/issuer.py PyCounters).
 *
 * Part of katsubushi_py._speedups: included once by _speedups.c, in the order written there (each part
 * uses the types and interned strings of the parts before it); see the comment at the top of _speedups.c
 * for what the twins are and the rule that keeps them identical.
 */

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
