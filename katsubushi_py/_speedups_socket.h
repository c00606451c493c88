/*
 * SocketCore, a socket transport's read and write (twin of daemon/sockets.py PySocketCore).
 *
 * Part of katsubushi_py._speedups: included once by _speedups.c, in the order written there (each part
 * uses the types and interned strings of the parts before it); see the comment at the top of _speedups.c
 * for what the twins are and the rule that keeps them identical.
 */

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
    errno = 0;
    int ok = tlsd_read_ex(self->ssl, sock_read_buffer, want, &n);
    if (!ok) {
        int saved_errno = errno;
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
        PyObject *exc = tlsd_exception(err, saved_errno);
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
        errno = 0;
        if (tlsd_write_ex(self->ssl, PyBytes_AS_STRING(data), (size_t)size, &written))
            n = (ssize_t)written;
        else {
            int saved_errno = errno;
            int err = tlsd_get_error(self->ssl, 0);
            if (err == TLSD_ERROR_WANT_WRITE || err == TLSD_ERROR_WANT_READ) {
                tlsd_err_clear();
                return PyObject_CallMethodOneArg((PyObject *)self, str_queue, data);
            }
            PyObject *exc = tlsd_exception(err, saved_errno);
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
