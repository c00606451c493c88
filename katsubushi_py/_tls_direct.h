/*
 * OpenSSL called directly on the SSL of Python's ssl objects: the TLS read and write of SocketCore
 * (included by _speedups.c; the twin is daemon/sockets.py PySocketCore, which calls the same SSL
 * through the object's read, write and pending).
 *
 * Why: going through the _ssl object's methods costs, per request, a method call, an argument
 * parse, a bytes object of 64 KiB allocated and shrunk, the GIL released and retaken around each
 * call, and OpenSSL reading every record in two read() calls (a header, then the body): together
 * about as much CPU as the rest of a small request. Here a read is one SSL_read_ex into the
 * module's read buffer, a write one SSL_write_ex, and the connection reads ahead (one read() a record
 * or more).
 *
 * How, without a crypto library of our own and without linking one: the functions are looked up
 * (dlsym) in the shared object of Python's own _ssl module, so they are exactly the OpenSSL that made
 * the connection (tls_direct_setup). The SSL of a connection is the second field of CPython's
 * PySSLSocket (after the weak reference to the socket), the same from 3.8 to 3.14; it is used only
 * after checking that OpenSSL's app data of that SSL points back to the very object (CPython sets it
 * to the object in newPySSLSocket). If anything does not match (another Python, another layout, no
 * _ssl shared object, KATSUBUSHI_TLS_DIRECT=0), the connection keeps the object's methods: slower,
 * the same behaviour.
 *
 * What OpenSSL reports is turned into what the Python path sees: want-read, want-write and the ends
 * of a stream are handled here as the Python callbacks would; anything else becomes the exception the
 * _ssl object would have raised (its kind, errno or OpenSSL's reason) and is handed to _tls_failed or
 * _tls_write_failed, which decide in Python.
 */
#include <dlfcn.h>
#include <errno.h>
#include <string.h>

typedef struct ssl_st SSL;

/* OpenSSL's values (ssl.h), stable since 1.0. */
#define TLSD_ERROR_SSL 1
#define TLSD_ERROR_WANT_READ 2
#define TLSD_ERROR_WANT_WRITE 3
#define TLSD_ERROR_SYSCALL 5
#define TLSD_ERROR_ZERO_RETURN 6

static int (*tlsd_read_ex)(SSL *, void *, size_t, size_t *);
static int (*tlsd_write_ex)(SSL *, const void *, size_t, size_t *);
static int (*tlsd_get_error)(const SSL *, int);
static int (*tlsd_has_pending)(const SSL *);
static void *(*tlsd_get_ex_data)(const SSL *, int);
static void (*tlsd_set_read_ahead)(SSL *, int);
static void (*tlsd_err_clear)(void);
static unsigned long (*tlsd_err_peek_last)(void);
static const char *(*tlsd_err_reason)(unsigned long);
static int tlsd_ready;
/* How this Python's _ssl reports a read that failed with errno set and nothing queued (a reset):
 * SSLEOFError (CPython before gh-115627: 3.10 to 3.12) or the OSError of errno (3.13 on). Probed by
 * the caller (daemon/sockets.py) on the same _ssl, and given to tls_direct_setup. */
static int tlsd_reset_is_eof = 1;
/* ssl.SSLError, SSLZeroReturnError, SSLEOFError: the exceptions handed to Python. */
static PyObject *tlsd_ssl_error, *tlsd_zero_return_error, *tlsd_eof_error;

/* tls_direct_setup(path, reset_is_eof=True): look OpenSSL up in the shared object at path
 * (_ssl.__file__); True when every function was found (then SocketCore uses it for every TLS object
 * that passes the check). reset_is_eof: how _ssl reports a reset (see tlsd_reset_is_eof).
 * tls_direct_setup(None) switches it off (KATSUBUSHI_TLS_DIRECT=0, tests). */
static PyObject *
tls_direct_setup(PyObject *module, PyObject *args)
{
    PyObject *path;
    int reset_is_eof = 1;
    if (!PyArg_ParseTuple(args, "O|p:tls_direct_setup", &path, &reset_is_eof))
        return NULL;
    tlsd_ready = 0;
    tlsd_reset_is_eof = reset_is_eof;
    if (path == Py_None)
        Py_RETURN_FALSE;
#if PY_VERSION_HEX < 0x03080000 || PY_VERSION_HEX >= 0x030F0000
    Py_RETURN_FALSE; /* a PySSLSocket layout this code was not checked against */
#else
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(path, &bytes))
        return NULL;
    /* RTLD_NOLOAD: only the _ssl that Python has loaded already (ssl is imported by the caller). */
    void *lib = dlopen(PyBytes_AS_STRING(bytes), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(bytes);
    if (lib == NULL)
        Py_RETURN_FALSE;
#define TLSD_FIND(var, name) (*(void **)&(var) = dlsym(lib, name)) == NULL
    int missing = TLSD_FIND(tlsd_read_ex, "SSL_read_ex") || TLSD_FIND(tlsd_write_ex, "SSL_write_ex") ||
                  TLSD_FIND(tlsd_get_error, "SSL_get_error") || TLSD_FIND(tlsd_has_pending, "SSL_has_pending") ||
                  TLSD_FIND(tlsd_get_ex_data, "SSL_get_ex_data") ||
                  TLSD_FIND(tlsd_set_read_ahead, "SSL_set_read_ahead") ||
                  TLSD_FIND(tlsd_err_clear, "ERR_clear_error") ||
                  TLSD_FIND(tlsd_err_peek_last, "ERR_peek_last_error") ||
                  TLSD_FIND(tlsd_err_reason, "ERR_reason_error_string");
#undef TLSD_FIND
    dlclose(lib); /* (RTLD_NOLOAD took a reference: _ssl stays loaded, its functions with it) */
    if (missing)
        Py_RETURN_FALSE;
    if (tlsd_ssl_error == NULL) {
        PyObject *ssl = PyImport_ImportModule("ssl");
        if (ssl == NULL)
            return NULL;
        tlsd_ssl_error = PyObject_GetAttrString(ssl, "SSLError");
        tlsd_zero_return_error = PyObject_GetAttrString(ssl, "SSLZeroReturnError");
        tlsd_eof_error = PyObject_GetAttrString(ssl, "SSLEOFError");
        Py_DECREF(ssl);
        if (!tlsd_ssl_error || !tlsd_zero_return_error || !tlsd_eof_error) {
            Py_CLEAR(tlsd_ssl_error);
            Py_CLEAR(tlsd_zero_return_error);
            Py_CLEAR(tlsd_eof_error);
            return NULL;
        }
    }
    tlsd_ready = 1;
    Py_RETURN_TRUE;
#endif
}

/* The SSL of a _ssl._SSLSocket object, or NULL when it cannot be trusted to be one (see the top). */
static SSL *
tlsd_ssl_of(PyObject *obj)
{
    if (!tlsd_ready)
        return NULL;
    PyTypeObject *tp = Py_TYPE(obj);
    const Py_ssize_t offset = (Py_ssize_t)(sizeof(PyObject) + sizeof(PyObject *));
    if (strcmp(tp->tp_name, "_ssl._SSLSocket") != 0 || tp->tp_basicsize < offset + (Py_ssize_t)sizeof(SSL *))
        return NULL;
    SSL *ssl = *(SSL **)((char *)obj + offset);
    if (ssl == NULL || tlsd_get_ex_data(ssl, 0) != (void *)obj)
        return NULL;
    return ssl;
}

/* OpenSSL 3's "unexpected eof while reading" (the peer's TCP close without close_notify), which _ssl
 * reports as SSLEOFError: library ERR_LIB_SSL (20), reason SSL_R_UNEXPECTED_EOF_WHILE_READING (294),
 * in OpenSSL 3's packing of an error code (not a system error: top bit clear; library in bits 23-30).
 * OpenSSL 1.1 reports the same end as SSL_ERROR_SYSCALL with nothing queued instead. */
static int
tlsd_unexpected_eof(unsigned long code)
{
    return (code & 0x80000000UL) == 0 && ((code >> 23) & 0xFFUL) == 20 && (code & 0x7FFFFFUL) == 294;
}

/* The exception the _ssl object's read or write raises for OpenSSL's error `err` of a failed
 * SSL_read_ex or SSL_write_ex (errno `saved_errno` just after it); OpenSSL's error queue is cleared,
 * as _ssl does. As there, a system error with nothing queued (a reset, a broken pipe) is the OSError
 * of errno or SSLEOFError, as this Python's _ssl does (tlsd_reset_is_eof); with errno 0 SSLEOFError;
 * OpenSSL's "unexpected eof" too; anything else SSLError with OpenSSL's reason. */
static PyObject *
tlsd_exception(int err, int saved_errno)
{
    unsigned long queued = tlsd_err_peek_last();
    PyObject *exc;
    if (err == TLSD_ERROR_ZERO_RETURN) {
        exc = PyObject_CallFunction(tlsd_zero_return_error, "is", 6, "TLS/SSL connection has been closed (EOF)");
    } else if (err == TLSD_ERROR_SYSCALL && queued == 0 && saved_errno != 0 && !tlsd_reset_is_eof) {
        errno = saved_errno;
        PyErr_SetFromErrno(PyExc_OSError);
#if PY_VERSION_HEX >= 0x030C0000
        exc = PyErr_GetRaisedException();
#else
        PyObject *type, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
#endif
    } else if ((err == TLSD_ERROR_SYSCALL && queued == 0) || (err == TLSD_ERROR_SSL && tlsd_unexpected_eof(queued))) {
        exc = PyObject_CallFunction(tlsd_eof_error, "is", 8, "EOF occurred in violation of protocol");
    } else {
        const char *reason = queued ? tlsd_err_reason(queued) : NULL;
        exc = PyObject_CallFunction(tlsd_ssl_error, "is", err == TLSD_ERROR_SSL ? 1 : err,
                                    reason ? reason : "A failure in the SSL library occurred");
    }
    tlsd_err_clear();
    return exc;
}
