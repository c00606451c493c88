/*
 * katsubushi_py._speedups: the compiled twin of the hot path.
 *
 * Small types, each the C twin of a pure-Python class that stays the reference and runs wherever
 * this module is not built or KATSUBUSHI_NO_EXTENSIONS=1 is set:
 *
 *   GeneratorCore  twin of issuing/bucket.py PyGeneratorCore: the current millisecond's unused IDs
 *                  (next .. stop), valid until the monotonic instant end_ns. Taking an ID is a clock
 *                  read, a comparison and an increment, atomic because the GIL is held throughout.
 *                  A new millisecond that needs no decision is set here as the generator's _refill
 *                  would set it (gen_roll, armed by that refill). Anything else (the fence, the state
 *                  file, waiting) is the Python generator's _refill, reached through _next_id_slow /
 *                  _next_ids_slow.
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
 * Each type is in a file of its own, included below in this order (a unity build: one translation unit,
 * so the build scripts compile this file alone): _speedups_generator.h, _speedups_counters.h,
 * _speedups_connection.h, _speedups_protocol.h, _speedups_socket.h (which includes _tls_direct.h).
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

#include "_speedups_generator.h"
#include "_speedups_counters.h"
#include "_speedups_connection.h"
#include "_speedups_protocol.h"
#include "_speedups_socket.h"

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
    {"tls_direct_setup", (PyCFunction)tls_direct_setup, METH_VARARGS,
     "tls_direct_setup(path or None, reset_is_eof=True): call OpenSSL of the _ssl module at path directly "
     "(see _tls_direct.h)."},
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
