/*
 * ProtocolCore, the asyncio protocol's data_received (twin of daemon/connection.py PyProtocolCore).
 *
 * Part of katsubushi_py._speedups: included once by _speedups.c, in the order written there (each part
 * uses the types and interned strings of the parts before it); see the comment at the top of _speedups.c
 * for what the twins are and the rule that keeps them identical.
 */

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
