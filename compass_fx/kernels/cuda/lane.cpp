// The fused calls' host fast path (compass_fx/kernels/cuda/lane.py says why and what it may skip).
//
// One function, `call`, does in C what a replayed eager call does in Python (ops._*_cuda ->
// impl.<op> -> _Workspace.run -> replay.Replays.graph -> Captured.launch) when the call's graph is
// already captured: it reads and writes the very Python objects that path uses (the workspace's
// epoch, its Progress ring, the Replays' graphs, the stats), so the two paths can take turns call
// by call.  Whenever anything is not as a plain replay needs it, it returns None before it has
// changed anything, and the Python path runs the call.  Everything here runs with the GIL held.
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <structmember.h>

#include <chrono>
#include <cstdint>
#include <vector>

namespace {

using Launch = int (*)(void* exec, void* stream);  // cuGraphLaunch(CUgraphExec, CUstream) -> CUresult

enum Op : long { GATHER = 0, SCATTER = 1, ALL_REDUCE = 2 };

struct Config {
  PyObject* lanes = nullptr;            // dict: lane key -> workspace (lane.register)
  PyObject* transports = nullptr;       // impl._transports: (raw transport, raw NCCL_P2P_DISABLE) -> str
  PyObject* env = nullptr;              // os.environ's bytes dict (impl reads settings from it too)
  PyObject* replay_settings = nullptr;  // replay._settings: raw COMPASS_FUSED_REPLAY -> bool
  PyObject* disabled = nullptr;         // replay._disabled: why replays were turned off
  PyObject* join = nullptr;             // impl.Join (its class attribute `outstanding`)
  PyObject* stats = nullptr;            // replay.stats
  PyObject* capturing = nullptr;        // () -> bool: the current stream is capturing
  PyObject* raw_stream = nullptr;       // (device index) -> the current stream's handle
  PyObject* check = nullptr;            // driver.check(result, what): raises
  PyObject* off = nullptr;              // the raw values of COMPASS_FUSED_LANE that set this path aside
  Launch launch = nullptr;
  long long period = 4, ring = 4096;
};

Config cfg;
bool configured = false;

// interned attribute names and environment keys
PyObject *s_pending, *s_dog, *s_failure, *s_replays, *s_graphs, *s_progress, *s_stream, *s_issued, *s_epochs,
    *s_address, *s_epoch, *s_exec, *s_move_to_end, *s_outstanding, *s_replayed, *s_lane, *s_launch_what;
PyObject *k_replay, *k_transport, *k_p2p, *k_cuda_fused, *k_lane, *k_piece, *k_most, *b_p2p;
PyObject *minus_one, *one;
PyObject* last_addresses = nullptr;  // what the last call looked its graph up by (for tests and diagnosis)

// Where the last call issued from here spent its host time, in ns (`phases`): what a profiler's
// overhead would hide in calls of tens of microseconds.  Five clock reads a call (~0.1 us).
enum Phase { CHECKS, OUTPUTS, PREPARE, LAUNCH, BOOKKEEPING, PHASES };
long long phase_ns[PHASES] = {};
long long launch_ns = 0;  // the launches of the call in hand, summed by `commit`
bool phased = false;      // phase_ns holds a call

inline long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

PyObject* env_get(PyObject* key) {  // borrowed, or Py_None
  PyObject* v = PyDict_GetItemWithError(cfg.env, key);
  return v ? v : Py_None;
}

using Weights = std::vector<const at::Tensor*>;

// A new reference to the lane key of a call, or nullptr (no error set) where there is none: the
// transport is not known yet for these settings.  The weights' widths: a tuple for the gather (it
// takes a list of weights), the one width for the others.
PyObject* key_of(long op, const at::Tensor& a, const Weights& ws, PyObject* schedule, PyObject* group_name,
                 PyObject* group_size) {
  PyObject* raw = PyTuple_Pack(2, env_get(k_transport), env_get(k_p2p));
  if (!raw) return nullptr;
  PyObject* transport = PyDict_GetItemWithError(cfg.transports, raw);  // borrowed
  Py_DECREF(raw);
  if (!transport) return nullptr;
  PyObject* cols = op == GATHER ? PyTuple_New((Py_ssize_t)ws.size()) : PyLong_FromLongLong(ws[0]->size(1));
  if (!cols) return nullptr;
  if (op == GATHER)
    for (size_t i = 0; i < ws.size(); ++i) PyTuple_SET_ITEM(cols, i, PyLong_FromLongLong(ws[i]->size(1)));
  PyObject* piece = op == ALL_REDUCE ? env_get(k_piece) : Py_None;
  PyObject* most = op == ALL_REDUCE ? env_get(k_most) : Py_None;
  return Py_BuildValue("(lOOOLLNiiOOO)", op, schedule, group_name, group_size, (long long)a.size(0),
                       (long long)a.size(1), cols, (int)a.scalar_type(), (int)a.get_device(), transport, piece, most);
}

bool unpack(PyObject* obj, const at::Tensor** out) {
  if (!THPVariable_Check(obj)) return false;
  *out = &THPVariable_Unpack(obj);
  return true;
}

// The weights of a call: the gather's list (none where it gathers alone: a ring all-reduce's sums),
// the others' one tensor.
bool unpack_weights(long op, PyObject* obj, Weights* ws) {
  if (op != GATHER) {
    const at::Tensor* w;
    if (!unpack(obj, &w)) return false;
    ws->push_back(w);
    return true;
  }
  if (!PyList_Check(obj)) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(obj); ++i) {
    const at::Tensor* w;
    if (!unpack(PyList_GET_ITEM(obj, i), &w)) return false;
    ws->push_back(w);
  }
  return true;
}

// Whether the settings the Python path reads on every call let a replay run here.
bool settings_allow() {
  PyObject* lane = env_get(k_lane);
  if (lane != Py_None && PySet_Contains(cfg.off, lane) != 0) return false;
  PyObject* fused = env_get(k_cuda_fused);
  if (fused != Py_None && PyObject_RichCompareBool(fused, b_p2p, Py_EQ) == 1) return false;
  if (PyList_GET_SIZE(cfg.disabled)) return false;
  PyObject* on = PyDict_GetItemWithError(cfg.replay_settings, env_get(k_replay));
  if (on != Py_True) return false;
  PyObject* outstanding = PyObject_GetAttr(cfg.join, s_outstanding);
  if (!outstanding) return false;
  int busy = PyObject_IsTrue(outstanding);
  Py_DECREF(outstanding);
  if (busy) return false;
  PyObject* capturing = PyObject_CallNoArgs(cfg.capturing);
  if (!capturing) return false;
  Py_DECREF(capturing);
  return capturing == Py_False;
}

// Holds new references and drops them on scope exit (`issue` takes ~40 at most, for two replays).
struct Refs {
  PyObject* items[64] = {};
  int n = 0;
  PyObject* operator()(PyObject* o) {
    if (o) items[n++] = o;
    return o;
  }
  ~Refs() {
    for (int i = 0; i < n; ++i) Py_DECREF(items[i]);
  }
};

PyObject* decline() {
  if (PyErr_Occurred()) PyErr_Clear();  // the Python path meets the same condition and says what it is
  Py_RETURN_NONE;
}

// impl._Workspace._addresses of a call (a new reference, or nullptr): the input, each weight and its
// strides, -1, the outputs, the gathered rows (or None).
PyObject* addresses_of(const at::Tensor& a, const Weights& ws, const std::vector<at::Tensor>& outs,
                       const at::Tensor* gathered) {
  PyObject* addresses = PyTuple_New(1 + 2 * (Py_ssize_t)ws.size() + 1 + (Py_ssize_t)outs.size() + 1);
  if (!addresses) return nullptr;
  Py_ssize_t slot = 0;
  PyTuple_SET_ITEM(addresses, slot++, PyLong_FromVoidPtr(a.data_ptr()));
  for (const at::Tensor* w : ws) {
    PyTuple_SET_ITEM(addresses, slot++, PyLong_FromVoidPtr(w->data_ptr()));
    PyTuple_SET_ITEM(addresses, slot++, Py_BuildValue("(LL)", (long long)w->stride(0), (long long)w->stride(1)));
  }
  Py_INCREF(minus_one);
  PyTuple_SET_ITEM(addresses, slot++, minus_one);
  for (const at::Tensor& out : outs) PyTuple_SET_ITEM(addresses, slot++, PyLong_FromVoidPtr(out.data_ptr()));
  if (gathered) {
    PyTuple_SET_ITEM(addresses, slot++, PyLong_FromVoidPtr(gathered->data_ptr()));
  } else {
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(addresses, slot++, Py_None);
  }
  for (Py_ssize_t i = 0; i < slot; ++i)
    if (!PyTuple_GET_ITEM(addresses, i)) {  // a number that could not be made
      Py_DECREF(addresses);
      return nullptr;
    }
  return addresses;
}

// One workspace's replay, looked up and checked before anything changes (`prepare`), then run
// (`commit`), as _Workspace.run's replay branch does it.
struct Replay {
  PyObject* workspace = nullptr;      // borrowed from the lanes
  PyObject* progress = nullptr;       // these: held by the call's Refs
  PyObject* graphs_by_key = nullptr;
  PyObject* addresses = nullptr;
  PyObject* issued_obj = nullptr;
  void* exec = nullptr;
  unsigned long long issued = 0;
  long long epoch = 0;
  bool same = false;  // the caller's stream is the one the workspace's last replay ran on
};

// Whether `workspace` can replay the call whose graph key is `addresses` (a new reference, handed
// over) on `stream` now: its settings, its graph for the next epoch's phase, room in its watchdog ring.
bool prepare(PyObject* workspace, PyObject* addresses, PyObject* stream, Refs& refs, Replay* r) {
  if (!refs(addresses)) return false;
  Py_INCREF(addresses);
  Py_XSETREF(last_addresses, addresses);
  r->workspace = workspace;
  r->addresses = addresses;
  PyObject* pending = refs(PyObject_GetAttr(workspace, s_pending));
  if (pending != Py_None) return false;
  PyObject* dog = refs(PyObject_GetAttr(workspace, s_dog));
  PyObject* failure = dog ? refs(PyObject_GetAttr(dog, s_failure)) : nullptr;
  if (!failure || PyObject_IsTrue(failure) != 0) return false;
  PyObject* replays = refs(PyObject_GetAttr(workspace, s_replays));
  r->progress = refs(PyObject_GetAttr(workspace, s_progress));
  if (!replays || replays == Py_None || !r->progress || r->progress == Py_None) return false;
  PyObject* epoch_obj = refs(PyObject_GetAttr(workspace, s_epoch));
  r->epoch = epoch_obj ? PyLong_AsLongLong(epoch_obj) + 1 : -1;
  if (r->epoch <= 0) return false;
  r->graphs_by_key = refs(PyObject_GetAttr(replays, s_graphs));
  if (!r->graphs_by_key || !PyDict_Check(r->graphs_by_key)) return false;
  PyObject* graphs = PyDict_GetItemWithError(r->graphs_by_key, addresses);  // borrowed: a list per phase
  if (!graphs || !PyList_Check(graphs) || PyList_GET_SIZE(graphs) != cfg.period) return false;
  PyObject* graph = PyList_GET_ITEM(graphs, r->epoch % cfg.period);
  if (graph == Py_None) return false;
  PyObject* exec_obj = refs(PyObject_GetAttr(graph, s_exec));
  r->exec = exec_obj && exec_obj != Py_None ? PyLong_AsVoidPtr(exec_obj) : nullptr;
  if (!r->exec) return false;
  // watchdog.Progress.room on the caller's stream
  PyObject* address = refs(PyObject_GetAttr(r->progress, s_address));
  r->issued_obj = refs(PyObject_GetAttr(r->progress, s_issued));
  PyObject* replay_stream = refs(PyObject_GetAttr(r->progress, s_stream));
  if (!address || !r->issued_obj || !replay_stream) return false;
  auto* done = static_cast<volatile uint32_t*>(PyLong_AsVoidPtr(address));
  r->issued = PyLong_AsUnsignedLongLong(r->issued_obj);
  if (PyErr_Occurred() || !done) return false;
  unsigned long long outstanding = (r->issued - *done) & 0xFFFFFFFFull;
  int same = PyObject_RichCompareBool(stream, replay_stream, Py_EQ);
  if (same < 0) return false;
  r->same = same == 1;
  return r->same ? outstanding < (unsigned long long)(cfg.ring - 1) : outstanding == 0;
}

// Run a prepared replay: the epoch, the graphs' recency, the stats, the watchdog's ring, the launch.
// False with a Python error set where something failed (the launch's: not counted in the ring).
bool commit(Replay& r, PyObject* stream, void* stream_handle, Refs& refs) {
  if (!r.same && PyObject_SetAttr(r.progress, s_stream, stream) < 0) return false;
  PyObject* new_epoch = refs(PyLong_FromLongLong(r.epoch));
  if (!new_epoch || PyObject_SetAttr(r.workspace, s_epoch, new_epoch) < 0) return false;
  PyObject* moved = PyObject_CallMethodOneArg(r.graphs_by_key, s_move_to_end, r.addresses);
  if (!moved) return false;
  Py_DECREF(moved);
  for (PyObject* name : {s_replayed, s_lane}) {  // replays, and those issued from here
    PyObject* count = PyDict_GetItemWithError(cfg.stats, name);
    PyObject* more = count ? refs(PyNumber_Add(count, one)) : nullptr;
    if (!more || PyDict_SetItem(cfg.stats, name, more) < 0) return false;
  }
  PyObject* epochs = refs(PyObject_GetAttr(r.progress, s_epochs));
  if (!epochs || !PyList_Check(epochs)) return false;
  Py_INCREF(new_epoch);
  if (PyList_SetItem(epochs, r.issued % cfg.ring, new_epoch) < 0) return false;
  PyObject* next = refs(PyLong_FromUnsignedLongLong(r.issued + 1));
  if (!next || PyObject_SetAttr(r.progress, s_issued, next) < 0) return false;
  long long launch_start = now_ns();
  int result = cfg.launch(r.exec, stream_handle);
  launch_ns += now_ns() - launch_start;
  if (result) {
    PyObject_SetAttr(r.progress, s_issued, r.issued_obj);
    PyObject* raised = PyObject_CallFunction(cfg.check, "iO", result, s_launch_what);  // raises
    if (raised) {
      Py_DECREF(raised);
      PyErr_Format(PyExc_RuntimeError, "cuGraphLaunch failed: CUDA driver error %d", result);
    }
    return false;
  }
  return true;
}

// The body of `call`; `committed` turns true once the call is this path's (a C++ exception before
// that, say an allocation that failed, declines: the Python path meets it again and raises its error).
// A ring all-reduce (impl.matmul_all_reduce without pull chunks) is two calls in Python, the fused
// reduce-scatter and a gather of its sums without weights: its lane holds both workspaces, and both
// replays are prepared before either runs, so the call is this path's whole or not at all.
PyObject* issue(PyObject* const* args, Py_ssize_t nargs, bool& committed) {
  long long entered = now_ns();
  phased = false;  // a call declined leaves no phases
  if (!configured || nargs != 6) return decline();
  long op = PyLong_AsLong(args[0]);
  PyObject *schedule = args[3], *group_name = args[4], *group_size = args[5];
  const at::Tensor* ap;
  Weights ws;
  if (!unpack(args[1], &ap) || !unpack_weights(op, args[2], &ws) || !settings_allow()) return decline();
  const at::Tensor& a = *ap;
  if (a.dim() != 2 || !a.is_contiguous()) return decline();
  for (const at::Tensor* w : ws)
    if (w->dim() != 2 || w->size(0) != a.size(1) || w->scalar_type() != a.scalar_type() || w->device() != a.device())
      return decline();
  Refs refs;
  PyObject* key = refs(key_of(op, a, ws, schedule, group_name, group_size));
  if (!key) return decline();
  PyObject* workspace = PyDict_GetItemWithError(cfg.lanes, key);  // borrowed
  if (!workspace) return decline();
  bool ring = PyTuple_Check(workspace);  // (reduce-scatter's, gather's): a ring all-reduce
  if (ring && (op != ALL_REDUCE || PyTuple_GET_SIZE(workspace) != 2)) return decline();
  long long world = PyLong_AsLongLong(group_size);
  if (world < 2) return decline();
  PyObject* device = refs(PyLong_FromLong(a.get_device()));
  PyObject* stream = device ? refs(PyObject_CallOneArg(cfg.raw_stream, device)) : nullptr;
  if (!stream) return decline();
  void* stream_handle = PyLong_AsVoidPtr(stream);
  if (PyErr_Occurred()) return decline();

  // the outputs, as the Python path allocates them (their addresses are part of the graphs' keys)
  long long checked = now_ns(), allocated = 0;
  std::vector<at::Tensor> outs;
  at::Tensor gathered;
  Replay first, second;
  if (ring) {  // the reduce-scatter's sums, then the gather of every rank's sums
    outs.push_back(at::empty({a.size(0) / world, ws[0]->size(1)}, a.options()));
    gathered = at::empty({a.size(0) / world * world, ws[0]->size(1)}, a.options());
    allocated = now_ns();
    const std::vector<at::Tensor> none;
    if (!prepare(PyTuple_GET_ITEM(workspace, 0), addresses_of(a, ws, outs, nullptr), stream, refs, &first) ||
        !prepare(PyTuple_GET_ITEM(workspace, 1), addresses_of(outs[0], {}, none, &gathered), stream, refs, &second))
      return decline();
  } else {
    long long out_rows = op == GATHER ? a.size(0) * world : op == SCATTER ? a.size(0) / world : a.size(0);
    if (op == GATHER) gathered = at::empty({out_rows, a.size(1)}, a.options());
    for (const at::Tensor* w : ws) outs.push_back(at::empty({out_rows, w->size(1)}, a.options()));
    allocated = now_ns();
    if (!prepare(workspace, addresses_of(a, ws, outs, op == GATHER ? &gathered : nullptr), stream, refs, &first))
      return decline();
  }

  // committed: from here on the call is this path's
  committed = true;
  long long prepared = now_ns();
  launch_ns = 0;
  if (!commit(first, stream, stream_handle, refs)) return nullptr;
  if (ring && !commit(second, stream, stream_handle, refs)) return nullptr;
  long long done = now_ns();
  phase_ns[CHECKS] = checked - entered, phase_ns[OUTPUTS] = allocated - checked;
  phase_ns[PREPARE] = prepared - allocated, phase_ns[LAUNCH] = launch_ns;
  phase_ns[BOOKKEEPING] = done - prepared - launch_ns;
  phased = true;
  if (ring) return THPVariable_Wrap(std::move(gathered));
  if (op == GATHER) {
    PyObject* listed = PyList_New((Py_ssize_t)outs.size());
    if (!listed) return nullptr;
    for (size_t i = 0; i < outs.size(); ++i) PyList_SET_ITEM(listed, i, THPVariable_Wrap(std::move(outs[i])));
    return Py_BuildValue("(NN)", THPVariable_Wrap(std::move(gathered)), listed);
  }
  return THPVariable_Wrap(std::move(outs[0]));
}

// call(op, a, b, schedule, group_name, group_size): the outputs of a replayed call, None (declined) or
// nullptr (an error set); ``b`` is the gather's list of weights, the other operators' weight.  No C++
// exception leaves it.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  bool committed = false;
  try {
    return issue(args, nargs, committed);
  } catch (const std::exception& e) {
    if (!committed) return decline();
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// The ``.graph`` overloads' eager entry (lane.py's `enter_from_c` says why).  A call on plain tensors
// of the kernel's device, outside any mode or transform, with the fast path on (``fast_calls`` not
// empty), goes straight to `issue`; one that `issue` declines goes to the op's Python path, which
// does not try C again; anything else to the overload's Python entry (`fallback`: ops._direct's,
// which tells a plain call from the rest as before and sends the rest through the dispatcher).
struct DirectConfig {
  PyTypeObject* tensor_type = nullptr;  // torch.Tensor: a subclass (fake, functional, Parameter) is not plain
  PyObject* quiet_checks = nullptr;     // () -> falsy where no dispatch mode, torch-function mode, transform is on
  PyObject* fast_calls = nullptr;       // lane.fast_calls: emptied to set the fast path aside
  c10::DeviceType device_type = c10::DeviceType::CUDA;
  bool configured = false;
};
DirectConfig direct_cfg;

struct Direct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* op;           // the operator's code (lane.OPS)
  PyObject* fallback;     // the overload's Python entry
  PyObject* python_path;  // the kernel's Python path, (a, b, schedule, group_name, group_size)
  int listed;             // the weights come as a list (the gather's): plain with every weight plain
};

bool plain_tensor(PyObject* o) { return Py_TYPE(o) == direct_cfg.tensor_type; }

// A weight is plain: an exact tensor that wants no gradient where grad mode is on (`grad`).
bool plain_weight(PyObject* w, bool grad) {
  return plain_tensor(w) && !(grad && THPVariable_Unpack(w).requires_grad());
}

// Every weight of a call is plain: the gather's list (at least one; Q, K and V share their gathered
// rows), the others' one tensor.
bool plain_weights(const Direct* d, PyObject* b, bool grad) {
  if (!d->listed) return plain_weight(b, grad);
  if (!PyList_CheckExact(b) || PyList_GET_SIZE(b) < 1) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(b); ++i)
    if (!plain_weight(PyList_GET_ITEM(b, i), grad)) return false;
  return true;
}

// What ops._plain_cuda / _plain_cuda_list check, the same way: exact tensors, the input on the kernel's
// device, no mode or transform, no gradient wanted.
bool plain_call(const Direct* d, PyObject* a, PyObject* b) {
  bool grad = c10::GradMode::is_enabled();
  if (!plain_tensor(a) || !plain_weights(d, b, grad)) return false;
  const at::Tensor& at_a = THPVariable_Unpack(a);
  if (at_a.device().type() != direct_cfg.device_type) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(direct_cfg.quiet_checks); ++i) {
    PyObject* on = PyObject_CallNoArgs(PyTuple_GET_ITEM(direct_cfg.quiet_checks, i));
    int truth = on ? PyObject_IsTrue(on) : -1;
    Py_XDECREF(on);
    if (truth != 0) {
      if (truth < 0) PyErr_Clear();  // the fallback meets it again and raises it
      return false;
    }
  }
  return !(grad && at_a.requires_grad());
}

PyObject* direct_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* d = reinterpret_cast<Direct*>(self);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  bool ready = direct_cfg.configured && PyList_GET_SIZE(direct_cfg.fast_calls) > 0;
  if (!ready || kwnames || nargs != 5 || !plain_call(d, args[0], args[1]))
    return PyObject_Vectorcall(d->fallback, args, nargsf, kwnames);
  PyObject* full[6] = {d->op, args[0], args[1], args[2], args[3], args[4]};
  PyObject* out = call(nullptr, full, 6);
  if (out != Py_None) return out;  // the outputs, or an error
  Py_DECREF(out);
  return PyObject_Vectorcall(d->python_path, args, nargs, nullptr);
}

void direct_dealloc(PyObject* self) {
  auto* d = reinterpret_cast<Direct*>(self);
  Py_XDECREF(d->op), Py_XDECREF(d->fallback), Py_XDECREF(d->python_path);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// ``through_dispatcher``: the fallback's (ops._direct's entries carry it; tests and tools read it)
PyObject* direct_through_dispatcher(PyObject* self, void*) {
  return PyObject_GetAttrString(reinterpret_cast<Direct*>(self)->fallback, "through_dispatcher");
}

PyMemberDef direct_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Direct, vectorcall), READONLY, nullptr},
    {"fallback", T_OBJECT_EX, offsetof(Direct, fallback), READONLY, "The overload's Python entry."},
    {"python_path", T_OBJECT_EX, offsetof(Direct, python_path), READONLY, "The kernel's Python path."},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef direct_getset[] = {
    {"through_dispatcher", direct_through_dispatcher, nullptr, "The overload's call through the dispatcher.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot direct_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(direct_dealloc)},
                              {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
                              {Py_tp_members, direct_members},
                              {Py_tp_getset, direct_getset},
                              {Py_tp_doc, const_cast<char*>("A .graph overload's eager entry into the fast path.")},
                              {0, nullptr}};

PyType_Spec direct_spec = {"compass_lane.Direct", sizeof(Direct), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, direct_slots};
PyObject* direct_type = nullptr;

// direct(op, fallback, python_path, listed): a .graph overload's entry (configure_direct first).
PyObject* direct(PyObject*, PyObject* args) {
  PyObject *op, *fallback, *python_path;
  int listed;
  if (!PyArg_ParseTuple(args, "O!OOp", &PyLong_Type, &op, &fallback, &python_path, &listed)) return nullptr;
  if (!direct_type && !(direct_type = PyType_FromSpec(&direct_spec))) return nullptr;
  auto* d = PyObject_New(Direct, reinterpret_cast<PyTypeObject*>(direct_type));
  if (!d) return nullptr;
  d->vectorcall = direct_vectorcall;
  Py_INCREF(op), Py_INCREF(fallback), Py_INCREF(python_path);
  d->op = op, d->fallback = fallback, d->python_path = python_path, d->listed = listed;
  return reinterpret_cast<PyObject*>(d);
}

// configure_direct(tensor_type, quiet_checks, fast_calls, device_type)
PyObject* configure_direct(PyObject*, PyObject* args) {
  PyObject *tensor_type, *quiet_checks, *fast_calls;
  const char* device;
  if (!PyArg_ParseTuple(args, "O!O!O!s", &PyType_Type, &tensor_type, &PyTuple_Type, &quiet_checks, &PyList_Type,
                        &fast_calls, &device))
    return nullptr;
  try {
    direct_cfg.device_type = c10::Device(std::string(device)).type();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  for (PyObject* o : {tensor_type, quiet_checks, fast_calls}) Py_INCREF(o);  // kept for the process's life
  direct_cfg.tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type);
  direct_cfg.quiet_checks = quiet_checks, direct_cfg.fast_calls = fast_calls;
  direct_cfg.configured = true;
  Py_RETURN_NONE;
}

// key(op, a, b, schedule, group_name, group_size): the lane key a call of these arguments looks its
// workspace up by, or None.
PyObject* key_unguarded(PyObject* const* args, Py_ssize_t nargs) {
  const at::Tensor* a;
  Weights ws;
  long op = nargs == 6 ? PyLong_AsLong(args[0]) : -1;
  if (!configured || nargs != 6 || !unpack(args[1], &a) || !unpack_weights(op, args[2], &ws)) return decline();
  PyObject* k = key_of(op, *a, ws, args[3], args[4], args[5]);
  return k ? k : decline();
}

PyObject* key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return key_unguarded(args, nargs);
  } catch (const std::exception&) {
    return decline();
  }
}

PyObject* looked_up(PyObject*, PyObject*) {
  if (!last_addresses) Py_RETURN_NONE;
  Py_INCREF(last_addresses);
  return last_addresses;
}

// phases(): (checks, outputs, prepare, launch, bookkeeping) in ns of the last call issued from here, or None.
PyObject* phases(PyObject*, PyObject*) {
  if (!phased) Py_RETURN_NONE;
  return Py_BuildValue("(LLLLL)", phase_ns[CHECKS], phase_ns[OUTPUTS], phase_ns[PREPARE], phase_ns[LAUNCH],
                       phase_ns[BOOKKEEPING]);
}

PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

// configure(lanes, transports, env, replay_settings, disabled, join, stats, capturing, raw_stream,
//           check, launch_address, period, ring, off)
PyObject* configure(PyObject*, PyObject* args) {
  unsigned long long launch;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!OO!OOOKLLO!", &PyDict_Type, &cfg.lanes, &PyDict_Type, &cfg.transports,
                        &PyDict_Type, &cfg.env, &PyDict_Type, &cfg.replay_settings, &PyList_Type, &cfg.disabled,
                        &cfg.join, &PyDict_Type, &cfg.stats, &cfg.capturing, &cfg.raw_stream, &cfg.check, &launch,
                        &cfg.period, &cfg.ring, &PyFrozenSet_Type, &cfg.off))
    return nullptr;
  for (PyObject* o : {cfg.lanes, cfg.transports, cfg.env, cfg.replay_settings, cfg.disabled, cfg.join, cfg.stats,
                      cfg.capturing, cfg.raw_stream, cfg.check, cfg.off})
    Py_INCREF(o);  // kept for the process's life (configure runs once)
  cfg.launch = reinterpret_cast<Launch>(static_cast<uintptr_t>(launch));
  s_pending = intern("pending"), s_dog = intern("dog"), s_failure = intern("failure");
  s_replays = intern("replays"), s_graphs = intern("graphs"), s_progress = intern("progress");
  s_stream = intern("stream"), s_issued = intern("issued"), s_epochs = intern("epochs");
  s_address = intern("address"), s_epoch = intern("epoch"), s_exec = intern("exec");
  s_move_to_end = intern("move_to_end"), s_outstanding = intern("outstanding"), s_replayed = intern("replayed");
  s_lane = intern("lane");
  s_launch_what = intern("cuGraphLaunch");
  k_replay = PyBytes_FromString("COMPASS_FUSED_REPLAY"), k_transport = PyBytes_FromString("COMPASS_FUSED_TRANSPORT");
  k_p2p = PyBytes_FromString("NCCL_P2P_DISABLE"), k_cuda_fused = PyBytes_FromString("COMPASS_CUDA_FUSED");
  k_lane = PyBytes_FromString("COMPASS_FUSED_LANE"), k_piece = PyBytes_FromString("COMPASS_HOST_PIECE_MIB");
  k_most = PyBytes_FromString("COMPASS_HOST_MOST_PIECES");
  b_p2p = PyBytes_FromString("p2p");
  minus_one = PyLong_FromLong(-1), one = PyLong_FromLong(1);
  configured = true;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
     "The outputs of a replayed fused call, or None: the Python path runs it."},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(key)), METH_FASTCALL,
     "The lane key of a call, or None."},
    {"last_addresses", looked_up, METH_NOARGS, "The addresses the last call looked its graph up by, or None."},
    {"phases", phases, METH_NOARGS, "Where the last call issued from here spent its host time (ns), or None."},
    {"configure", configure, METH_VARARGS, "Hand the lane the Python objects it reads and writes."},
    {"configure_direct", configure_direct, METH_VARARGS,
     "Hand the .graph overloads' entries what tells a plain call: the tensor type, the mode checks, fast_calls."},
    {"direct", direct, METH_VARARGS, "A .graph overload's eager entry: (op, fallback, python_path, listed)."},
    {nullptr, nullptr, 0, nullptr}};

#define COMPASS_STR2(x) #x
#define COMPASS_STR(x) COMPASS_STR2(x)
#define COMPASS_CAT2(a, b) a##b
#define COMPASS_CAT(a, b) COMPASS_CAT2(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, COMPASS_STR(TORCH_EXTENSION_NAME), "The fused calls' host fast path.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC COMPASS_CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
