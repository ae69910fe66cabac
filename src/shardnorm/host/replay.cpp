// The eager host path: a norm call's allocations and Triton launches, recorded once per call signature by
// the Python plans (host/record.py), replayed from C++ with the call's own tensors, under a C++ autograd
// node. No Python runs in a replayed forward or backward; an unknown signature runs the Python path once
// through a callback, which records it. See host/__init__.py for when this path is taken.
//
// Built with torch's CPU headers only: the driver's cuLaunchKernel comes from libcuda at run time, the
// current stream through c10's device-guard interface, so the same source builds on a CPU machine (where a
// test launcher stands in for the driver).

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Key = std::vector<int64_t>;
using OptTensor = std::optional<at::Tensor>;

// Roles of a launch's tensor arguments: the call's inputs by position, then the call's allocations.
constexpr int64_t kAllocBase = 8;
constexpr size_t kMaxParams = 64;

struct Param {
  bool pointer;   // a tensor's address: `value` is its role
  int64_t value;  // else the argument's bytes (little-endian, zero-padded to 8)
};

struct Launch {
  uint64_t function;  // CUfunction, loaded by Triton in this device's primary context
  std::array<unsigned, 3> grid;
  unsigned block, shared;
  int trailing_nulls;  // Triton's scratch pointers after the kernel's own arguments
  std::vector<Param> params;
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Spec {
  bool replay;  // false: this signature runs the Python path every time (not replayable)
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<int64_t> outputs;  // role per output, -1 for None
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = key.size();
    for (int64_t v : key) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

// Calls replayed and calls the Python path ran, forward and backward (host.stats()).
std::array<std::atomic<int64_t>, 4> counts{};
enum Count { kReplayedForward, kReplayedBackward, kPythonForward, kPythonBackward };

std::mutex specs_mutex;
std::unordered_map<Key, std::shared_ptr<const Spec>, KeyHash> specs;
size_t capacity = 1024;  // signatures remembered; past it, unknown ones run the Python path unrecorded

// Python callbacks (never destroyed: a py::object must not outlive the interpreter's shutdown)
struct Callbacks {
  py::object record_forward, record_backward;  // the Python paths that run (and record) unknown signatures
  py::object ready;  // a grad that is a Python subclass -> the tensor behind it (a collective's pending result)
  py::object test_launcher;                    // in place of cuLaunchKernel, for tests without a GPU
};
Callbacks& callbacks() {
  static auto* c = new Callbacks();
  return *c;
}

std::shared_ptr<const Spec> find(const Key& key) {
  std::lock_guard<std::mutex> lock(specs_mutex);
  auto it = specs.find(key);
  return it == specs.end() ? nullptr : it->second;
}

bool may_record() {
  std::lock_guard<std::mutex> lock(specs_mutex);
  return specs.size() < capacity;
}

// ---- the driver ------------------------------------------------------------------------------------------

// A libcuda entry point (the library is loaded already by torch and Triton).
template <typename Fn>
Fn cuda_symbol(const char* name) {
  static void* lib = [] {
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return handle != nullptr ? handle : dlopen("libcuda.so.1", RTLD_NOW);
  }();
  TORCH_CHECK(lib != nullptr, "shardnorm host path: cannot open libcuda.so.1");
  auto fn = reinterpret_cast<Fn>(dlsym(lib, name));
  TORCH_CHECK(fn != nullptr, "shardnorm host path: libcuda.so.1 has no ", name);
  return fn;
}

using LaunchKernelFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                               void**, void**);

LaunchKernelFn driver_launch() {
  static LaunchKernelFn fn = cuda_symbol<LaunchKernelFn>("cuLaunchKernel");
  return fn;
}

// The device's primary context current on this thread, as Triton's launcher makes sure before each launch: a
// thread that has not touched the CUDA runtime yet has none, and cuLaunchKernel would fail there.
void ensure_context(const at::Device& device) {
  thread_local int bound = -1;
  if (bound == device.index()) return;
  static auto get_current = cuda_symbol<int (*)(void**)>("cuCtxGetCurrent");
  static auto device_get = cuda_symbol<int (*)(int*, int)>("cuDeviceGet");
  static auto retain = cuda_symbol<int (*)(void**, int)>("cuDevicePrimaryCtxRetain");
  static auto set_current = cuda_symbol<int (*)(void*)>("cuCtxSetCurrent");
  void* context = nullptr;
  TORCH_CHECK(get_current(&context) == 0, "shardnorm host path: cuCtxGetCurrent failed");
  if (context == nullptr) {
    int dev = 0;
    TORCH_CHECK(device_get(&dev, device.index()) == 0 && retain(&context, dev) == 0 && set_current(context) == 0,
                "shardnorm host path: cannot make device ", device.index(), "'s primary context current");
  }
  bound = device.index();
}

void* current_stream(const at::Device& device) {
  const auto* guard = c10::impl::getDeviceGuardImpl(device.type());
  return guard->getStream(device).native_handle();
}

// ---- keys: what a recorded call's launches and allocations depend on --------------------------------------
// A tensor's dtype, 16-byte alignment and (rows) row stride: what the plans choose by and Triton specializes
// on. The rest of the key (M, N, eps, flags) is pushed by the callers.

int64_t dtype_code(const at::Tensor& t) {
  bool aligned = (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
  return static_cast<int64_t>(t.scalar_type()) | (aligned ? 256 : 0);
}

// The row stride of t as M rows of N (a 2-D tensor with unit column stride, or any contiguous [..., N]), or -1.
int64_t row_stride(const at::Tensor& t, int64_t M, int64_t N) {
  if (t.dim() == 2) return t.size(0) == M && t.size(1) == N && t.stride(1) == 1 ? t.stride(0) : -1;
  return t.dim() >= 1 && t.size(-1) == N && t.numel() == M * N && t.is_contiguous() ? N : -1;
}

// t as the [M, N] rows the Python path takes (a view where t is not 2-D and its strides allow, else a copy).
at::Tensor as_rows(const at::Tensor& t, int64_t N) {
  return !t.defined() || t.dim() == 2 ? t : t.reshape({-1, N});
}

// A 2-D result of the Python path in the caller's shape, as a tensor of its own (not a view: a Function's
// output that is a view of something else refuses in-place ops later).
at::Tensor in_shape(const at::Tensor& t, at::IntArrayRef sizes) {
  return !t.defined() || t.sizes() == sizes ? t : at::_unsafe_view(t, sizes);
}

bool push_rows(Key& key, const at::Tensor& t, int64_t M, int64_t N, const at::Device& device) {
  if (!t.defined()) {
    key.push_back(-1);
    return true;
  }
  int64_t stride = row_stride(t, M, N);
  if (stride < 0 || t.device() != device) return false;
  key.push_back(dtype_code(t));
  key.push_back(stride);
  return true;
}

bool push_param(Key& key, const OptTensor& p, int64_t N, const at::Device& device) {
  if (!p.has_value() || !p->defined()) {
    key.push_back(-1);
    return true;
  }
  if (p->dim() != 1 || p->size(0) != N || (N > 1 && p->stride(0) != 1) || p->device() != device) return false;
  key.push_back(dtype_code(*p));
  return true;
}

// Which inputs share an address (the same grad handed to two outputs, say): a recording names each tensor by
// its address, so a replay must see the same sharing.
void push_aliases(Key& key, std::initializer_list<const at::Tensor*> tensors) {
  std::vector<const void*> seen;
  for (const at::Tensor* t : tensors) {
    const void* ptr = t->defined() ? t->data_ptr() : nullptr;
    auto it = ptr == nullptr ? seen.end() : std::find(seen.begin(), seen.end(), ptr);
    key.push_back(it == seen.end() ? -1 : it - seen.begin());
    seen.push_back(ptr);
  }
}

// ---- replay -----------------------------------------------------------------------------------------------

// The recorded launches on `inputs` (by role); `shape`: the call's [..., N] shape, which the recorded [M, N]
// contiguous allocations (y, z, dx) take: the same memory, the caller's sizes.
std::vector<at::Tensor> replay(const Spec& spec, const at::Tensor* inputs, const at::Device& device,
                               at::IntArrayRef shape) {
  std::vector<at::Tensor> allocs;
  allocs.reserve(spec.allocs.size());
  int64_t N = shape.back(), M = N == 0 ? 0 : c10::multiply_integers(shape) / N;
  bool reshape = shape.size() != 2;
  for (const Alloc& a : spec.allocs) {
    auto options = at::TensorOptions().dtype(a.dtype).device(device);
    bool rows = reshape && a.sizes.size() == 2 && a.sizes[0] == M && a.sizes[1] == N && a.strides[1] == 1 &&
                a.strides[0] == N;
    allocs.push_back(rows ? at::empty(shape, options) : at::empty_strided(a.sizes, a.strides, options));
  }
  auto tensor = [&](int64_t role) -> const at::Tensor& {
    return role < kAllocBase ? inputs[role] : allocs[role - kAllocBase];
  };
  void* stream = nullptr;
  if (!spec.launches.empty() && device.is_cuda()) {
    ensure_context(device);
    stream = current_stream(device);
  }
  for (const Launch& l : spec.launches) {
    if (static_cast<uint64_t>(l.grid[0]) * l.grid[1] * l.grid[2] == 0) continue;  // as Triton's launcher
    std::array<uint64_t, kMaxParams> values;
    std::array<void*, kMaxParams> pointers;
    size_t n = 0;
    for (const Param& p : l.params) {
      values[n] = p.pointer ? reinterpret_cast<uint64_t>(tensor(p.value).data_ptr()) : static_cast<uint64_t>(p.value);
      pointers[n] = &values[n];
      ++n;
    }
    for (int i = 0; i < l.trailing_nulls; ++i, ++n) {
      values[n] = 0;
      pointers[n] = &values[n];
    }
    if (callbacks().test_launcher) {
      py::gil_scoped_acquire gil;
      callbacks().test_launcher(l.function, py::make_tuple(l.grid[0], l.grid[1], l.grid[2]), l.block, l.shared,
                                std::vector<uint64_t>(values.begin(), values.begin() + n),
                                reinterpret_cast<uint64_t>(stream));
      continue;
    }
    int rc = driver_launch()(reinterpret_cast<void*>(l.function), l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1,
                             l.shared, stream, pointers.data(), nullptr);
    TORCH_CHECK(rc == 0, "shardnorm host path: cuLaunchKernel failed (CUresult ", rc, ")");
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(spec.outputs.size());
  for (int64_t role : spec.outputs) outputs.push_back(role < 0 ? at::Tensor() : tensor(role));
  return outputs;
}

at::Tensor tensor_of(const py::handle& obj) {
  return obj.is_none() ? at::Tensor() : obj.cast<at::Tensor>();
}

py::object none_if_undefined(const at::Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

// ---- forward and backward of one call ---------------------------------------------------------------------

// y, z, mean, rstd of a norm of x [..., N]: replayed, or the Python path's (recording it when `key` is new and
// there is room); y and z in x's shape.
std::vector<at::Tensor> forward_outputs(const Key* key, const at::Tensor& x, const OptTensor& weight,
                                        const OptTensor& bias, const OptTensor& residual, double eps, bool rms,
                                        bool zero_centered) {
  std::shared_ptr<const Spec> spec = key != nullptr ? find(*key) : nullptr;
  at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
  at::Tensor r = residual.value_or(at::Tensor());
  if (spec && spec->replay) {
    std::array<at::Tensor, 4> inputs{x, w, b, r};
    ++counts[kReplayedForward];
    return replay(*spec, inputs.data(), x.device(), x.sizes());
  }
  ++counts[kPythonForward];
  int64_t N = x.size(-1);
  py::gil_scoped_acquire gil;
  bool record = key != nullptr && !spec && may_record();
  py::tuple out = callbacks().record_forward(record ? py::cast(*key) : py::none(), as_rows(x, N),
                                             none_if_undefined(w), none_if_undefined(b),
                                             none_if_undefined(as_rows(r, N)), eps, rms, zero_centered);
  at::Tensor z = tensor_of(out[1]);  // the torch backend's absent z is empty
  return {in_shape(tensor_of(out[0]), x.sizes()), r.defined() ? in_shape(z, x.sizes()) : z, tensor_of(out[2]),
          tensor_of(out[3])};
}

bool is_python(const at::Tensor& t) {  // a Python tensor subclass (its own data is not what it holds)
  return t.defined() && t.key_set().has(c10::DispatchKey::Python);
}

enum Flag { kHasBias = 1, kHasResidual = 2, kRms = 4, kZeroCentered = 8 };

struct NormFunction : public torch::autograd::Function<NormFunction> {
  // key: the forward's signature (nullptr: not replayable, e.g. a tensor the key cannot describe); x_data,
  // residual_data: the tensors the kernels read where x / residual (the autograd edges) are wrappers, a
  // collective's pending result (AsyncCollectiveTensor) waited on by the caller. Pointers, so that the node has
  // no edges to them (a tensor argument would be one more input).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                               const OptTensor& bias, const OptTensor& residual, double eps, bool rms,
                               bool zero_centered, const Key* key, const at::Tensor* x_data,
                               const OptTensor* residual_data) {
    auto out = forward_outputs(key, *x_data, weight, bias, *residual_data, eps, rms, zero_centered);
    bool has_residual = residual.has_value();
    ctx->save_for_backward({has_residual ? out[1] : *x_data, weight.value_or(at::Tensor()), out[2], out[3]});
    ctx->saved_data["key"] = key != nullptr ? c10::IValue(*key) : c10::IValue();
    ctx->saved_data["flags"] = static_cast<int64_t>((bias.has_value() ? kHasBias : 0) |
                                                    (has_residual ? kHasResidual : 0) | (rms ? kRms : 0) |
                                                    (zero_centered ? kZeroCentered : 0));
    if (has_residual) return {out[0], out[1]};
    return {out[0]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();  // src (x or x + residual), weight, mean, rstd
    int64_t flags = ctx->saved_data["flags"].toInt();
    bool has_bias = flags & kHasBias, has_residual = flags & kHasResidual;
    at::Tensor dy = grads[0], dz = has_residual ? grads[1] : at::Tensor();
    // Grads that are Python subclasses (under sequence parallel, a collective's pending result) have no memory
    // the kernels may read: the tensor behind them, waited on; one that stays a subclass is the Python path's.
    bool wrapped = is_python(dy) || is_python(dz);
    if (wrapped) {
      py::gil_scoped_acquire gil;
      if (callbacks().ready) {
        dy = tensor_of(callbacks().ready(none_if_undefined(dy)));
        dz = tensor_of(callbacks().ready(none_if_undefined(dz)));
      }
      wrapped = is_python(dy) || is_python(dz);
    }
    const c10::IValue& forward_key = ctx->saved_data["key"];
    const at::Tensor& src = saved[0];
    int64_t N = src.size(-1), M = src.numel() / N;
    std::shared_ptr<const Spec> spec;
    Key key;
    bool keyed = false;
    if (forward_key.isIntList() && !wrapped) {
      key = forward_key.toIntVector();
      // the saved tensors as they come back (a saved-tensor hook, e.g. offloading, may hand back a copy of
      // another layout), then the incoming grads
      keyed = push_rows(key, src, M, N, src.device()) && push_rows(key, dy, M, N, src.device()) &&
              push_rows(key, dz, M, N, src.device());
      for (int i = 1; i < 4; ++i) key.push_back(saved[i].defined() ? dtype_code(saved[i]) : -1);
      push_aliases(key, {&dy, &dz, &src, &saved[1], &saved[2], &saved[3]});
      if (keyed) spec = find(key);
    }
    std::vector<at::Tensor> out;
    if (spec && spec->replay) {
      std::array<at::Tensor, 6> inputs{dy, dz, src, saved[1], saved[2], saved[3]};
      ++counts[kReplayedBackward];
      out = replay(*spec, inputs.data(), src.device(), src.sizes());
    } else {
      ++counts[kPythonBackward];
      py::gil_scoped_acquire gil;
      bool record = keyed && !spec && may_record();
      // rows (dy's a copy where it is not contiguous), dx back in src's shape
      py::tuple result = callbacks().record_backward(
          record ? py::cast(key) : py::none(), as_rows(dy, N), none_if_undefined(as_rows(dz, N)), as_rows(src, N),
          none_if_undefined(saved[1]), none_if_undefined(saved[2]), saved[3], has_bias, bool(flags & kRms),
          bool(flags & kZeroCentered));
      out = {tensor_of(result[0]).view(src.sizes()), tensor_of(result[1]), tensor_of(result[2])};
    }
    // grads of (x, weight, bias, residual, eps, rms, zero_centered, key, x_data, residual_data)
    return {out[0], saved[1].defined() ? out[1] : at::Tensor(), has_bias ? out[2] : at::Tensor(),
            has_residual ? out[0] : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// The forward's key, or false where the call does not fit one (the Python path then runs it, unrecorded).
bool forward_key(Key& key, const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                 const OptTensor& residual, double eps, bool rms, bool zero_centered) {
  if (x.dim() == 0) return false;
  const at::Device device = x.device();
  int64_t N = x.size(-1), M = N == 0 ? 0 : x.numel() / N;
  if (M == 0) return false;
  if (device.type() == at::kCUDA) {  // Triton launches on the current device
    if (c10::impl::getDeviceGuardImpl(device.type())->getDevice() != device) return false;
  } else if (!(device.is_cpu() && callbacks().test_launcher)) {  // CPU tensors: only for a test launcher
    return false;
  }
  key.reserve(16);
  key.push_back(device.index());
  key.push_back(M);
  key.push_back(N);
  int64_t eps_bits;
  std::memcpy(&eps_bits, &eps, sizeof eps_bits);
  key.push_back(eps_bits);
  key.push_back(rms | zero_centered << 1);
  const at::Tensor &w = weight.value_or(at::Tensor()), &b = bias.value_or(at::Tensor());
  const at::Tensor& r = residual.value_or(at::Tensor());
  if (!(push_rows(key, x, M, N, device) && push_param(key, weight, N, device) && push_param(key, bias, N, device) &&
        push_rows(key, r, M, N, device))) {
    return false;
  }
  push_aliases(key, {&x, &w, &b, &r});
  return true;
}

// Inputs the Python path must take: forward-mode AD tangents (it raises for them; a replay would drop them), and
// tensors without storage of their own (functorch wrappers, which it unwraps; Python subclasses such as a
// collective's pending result, whose data the caller hands over as x_data).
bool python_only(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && (!t->has_storage() || t->layout() != at::kStrided || t->_fw_grad(/*level=*/0).defined() ||
                         is_python(*t))) {
      return true;
    }
  }
  return false;
}

// The differentiable norm of x [..., N] (rows with unit column stride): (y, x + residual or undefined). The
// kernels read x_data / residual_data (x / residual themselves unless given; see NormFunction).
std::pair<at::Tensor, at::Tensor> run_norm(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                           const OptTensor& residual, double eps, bool rms, bool zero_centered,
                                           const at::Tensor& x_data, const OptTensor& residual_data) {
  Key key;
  bool keyed = forward_key(key, x_data, weight, bias, residual_data, eps, rms, zero_centered);
  const Key* k = keyed ? &key : nullptr;
  bool needs_grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (weight && weight->requires_grad()) || (bias && bias->requires_grad()) ||
                     (residual && residual->requires_grad()));
  if (!needs_grad) {  // no autograd node to build
    auto out = forward_outputs(k, x_data, weight, bias, residual_data, eps, rms, zero_centered);
    return {out[0], residual ? out[1] : at::Tensor()};
  }
  variable_list out = NormFunction::apply(x, weight, bias, residual, eps, rms, zero_centered, k, &x_data,
                                          &residual_data);
  return {out[0], out.size() > 1 ? out[1] : at::Tensor()};
}

// Whether `data` (where given) may stand in for the wrapper `t` it holds: the same sizes, strides, dtype and device,
// and no forward-mode tangent on the wrapper (the Python path raises for one; a replay would drop it).
bool stands_in(const OptTensor& data, const at::Tensor* t) {
  return !data || (t != nullptr && data->sizes() == t->sizes() && data->strides() == t->strides() &&
                   data->scalar_type() == t->scalar_type() && data->device() == t->device() &&
                   !t->_fw_grad(/*level=*/0).defined());
}

// ops.norm's entry: 2-D x [M, N] checked by the caller. -> (y, x + residual or None), or None for the Python path.
// x_data / residual_data: what x / residual hold where they are wrappers (a collective's pending result, waited
// on by the caller), read by the kernels; x / residual stay the autograd edges.
py::object norm(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                double eps, bool rms, bool zero_centered, const OptTensor& x_data, const OptTensor& residual_data) {
  const at::Tensor none;
  const at::Tensor& xd = x_data ? *x_data : x;
  const OptTensor& rd = residual_data ? residual_data : residual;
  if (!stands_in(x_data, &x) || !stands_in(residual_data, residual ? &*residual : nullptr) ||
      python_only({&xd, weight ? &*weight : &none, bias ? &*bias : &none, rd ? &*rd : &none})) {
    return py::none();
  }
  auto [y, z] = run_norm(x, weight, bias, residual, eps, rms, zero_centered, xd, rd);
  return py::make_tuple(y, none_if_undefined(z));
}

// ---- the modules' and functional API's entry: every check of functional._check, or None ----------------

bool supported_dtype(const at::Tensor& t) {
  auto dtype = t.scalar_type();
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// A plain tensor (or Parameter) behind `obj`, or nullptr (None, a subclass such as a DTensor, not a tensor).
const at::Tensor* plain_tensor(py::handle obj) {
  return THPVariable_CheckExact(obj.ptr()) ? &THPVariable_Unpack(obj.ptr()) : nullptr;
}

// normalized_shape as N: an int, or a tuple/list/Size of one int; -1 otherwise.
int64_t single_size(py::handle shape) {
  if (PyLong_CheckExact(shape.ptr())) return PyLong_AsLongLong(shape.ptr());
  if ((PyTuple_Check(shape.ptr()) || PyList_Check(shape.ptr())) && PySequence_Size(shape.ptr()) == 1) {
    py::object n = py::reinterpret_steal<py::object>(PySequence_GetItem(shape.ptr(), 0));
    if (PyLong_CheckExact(n.ptr())) return PyLong_AsLongLong(n.ptr());
  }
  return -1;
}

double default_eps(at::ScalarType dtype) {  // torch.finfo(dtype).eps, rms_norm's default
  return dtype == at::kFloat ? 1.1920928955078125e-07 : dtype == at::kBFloat16 ? 0.0078125 : 0.0009765625;
}

// norm(x, residual, normalized_shape, weight, bias, eps, rms, zero_centered) as functional._norm returns it,
// (y, x + residual or None), where the call is one this path takes as it is; None where the Python path must
// look at it (a DTensor or other subclass, another shape, device or dtype, a bad argument it must name,
// SHARDNORM_BACKEND set, functorch transforms running).
py::object module_norm(py::handle x_obj, py::handle residual_obj, py::handle shape, py::handle weight_obj,
                       py::handle bias_obj, py::handle eps_obj, bool rms, bool zero_centered) {
  const at::Tensor* x = plain_tensor(x_obj);
  if (x == nullptr || !supported_dtype(*x) || x->dim() == 0 || std::getenv("SHARDNORM_BACKEND") != nullptr) {
    return py::none();
  }
  if (!x->is_cuda() && !(x->is_cpu() && callbacks().test_launcher)) return py::none();  // CPU: the torch backend
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) return py::none();
  int64_t N = single_size(shape);
  if (N <= 0 || x->size(-1) != N || x->numel() == 0 || row_stride(*x, x->numel() / N, N) < 0) return py::none();
  const at::Device device = x->device();
  OptTensor params[2];
  py::handle objs[2] = {weight_obj, bias_obj};
  for (int i = 0; i < 2; ++i) {
    if (objs[i].is_none()) continue;
    const at::Tensor* p = plain_tensor(objs[i]);
    if (p == nullptr || !supported_dtype(*p) || p->dim() != 1 || p->size(0) != N || p->device() != device ||
        (N > 1 && p->stride(0) != 1)) {
      return py::none();
    }
    params[i] = *p;
  }
  OptTensor residual;
  if (!residual_obj.is_none()) {
    const at::Tensor* r = plain_tensor(residual_obj);
    if (r == nullptr || !supported_dtype(*r) || r->sizes() != x->sizes() || r->device() != device ||
        row_stride(*r, x->numel() / N, N) < 0) {
      return py::none();
    }
    residual = *r;
  }
  const at::Tensor none;
  if (python_only({x, params[0] ? &*params[0] : &none, params[1] ? &*params[1] : &none,
                   residual ? &*residual : &none})) {
    return py::none();
  }
  double eps;
  if (eps_obj.is_none()) {
    eps = default_eps(x->scalar_type());
  } else if (PyFloat_CheckExact(eps_obj.ptr()) || PyLong_CheckExact(eps_obj.ptr())) {
    eps = PyFloat_AsDouble(eps_obj.ptr());
    if (eps == -1.0 && PyErr_Occurred()) {  // an int too large for a double: the Python path's error
      PyErr_Clear();
      return py::none();
    }
    if (!(eps >= 0)) return py::none();  // the Python path says what is wrong (NaN too)
  } else {
    return py::none();
  }
  auto [y, z] = run_norm(*x, params[0], params[1], residual, eps, rms, zero_centered, *x, residual);
  return py::make_tuple(y, none_if_undefined(z));
}

// ---- recording: specs from Python -------------------------------------------------------------------------

// params: (pointer, value) pairs; launches: (function, (gx, gy, gz), block, shared, trailing_nulls, params);
// allocs: (sizes, strides, dtype code); outputs: roles (-1: None).
using AllocArg = std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::ScalarType>;
using LaunchArg = std::tuple<uint64_t, std::tuple<unsigned, unsigned, unsigned>, unsigned, unsigned, int,
                             std::vector<std::pair<bool, int64_t>>>;

void add_spec(const Key& key, bool replayable, const std::vector<AllocArg>& allocs,
              const std::vector<LaunchArg>& launches, const std::vector<int64_t>& outputs) {
  auto spec = std::make_shared<Spec>();
  spec->replay = replayable;
  for (const auto& [sizes, strides, dtype] : allocs) {
    TORCH_CHECK(sizes.size() == strides.size(), "add_spec: sizes and strides differ in length");
    spec->allocs.push_back({sizes, strides, dtype});
  }
  int64_t roles = kAllocBase + static_cast<int64_t>(spec->allocs.size());
  for (const auto& [function, grid, block, shared, trailing_nulls, params] : launches) {
    TORCH_CHECK(params.size() + trailing_nulls <= kMaxParams, "add_spec: over ", kMaxParams, " kernel arguments");
    Launch l{function, {std::get<0>(grid), std::get<1>(grid), std::get<2>(grid)}, block, shared, trailing_nulls, {}};
    for (const auto& [pointer, value] : params) {
      TORCH_CHECK(!pointer || (value >= 0 && value < roles), "add_spec: pointer role ", value, " out of range");
      l.params.push_back({pointer, value});
    }
    spec->launches.push_back(std::move(l));
  }
  for (int64_t role : outputs) TORCH_CHECK(role < roles, "add_spec: output role ", role, " out of range");
  spec->outputs = outputs;
  std::lock_guard<std::mutex> lock(specs_mutex);
  if (specs.size() < capacity || specs.count(key)) specs[key] = std::move(spec);
}

void set_callbacks(py::object forward, py::object backward, py::object ready) {
  callbacks().ready = ready.is_none() ? py::object() : std::move(ready);
  callbacks().record_forward = std::move(forward);
  callbacks().record_backward = std::move(backward);
}

void set_test_launcher(py::object launcher) {
  callbacks().test_launcher = launcher.is_none() ? py::object() : std::move(launcher);
}

void clear() {
  std::lock_guard<std::mutex> lock(specs_mutex);
  specs.clear();
}

size_t size() {
  std::lock_guard<std::mutex> lock(specs_mutex);
  return specs.size();
}

py::dict stats() {
  py::dict d;
  d["replayed_forward"] = counts[kReplayedForward].load();
  d["replayed_backward"] = counts[kReplayedBackward].load();
  d["python_forward"] = counts[kPythonForward].load();
  d["python_backward"] = counts[kPythonBackward].load();
  return d;
}

void set_capacity(size_t n) {
  std::lock_guard<std::mutex> lock(specs_mutex);
  capacity = n;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm", &norm, "Differentiable norm of [M, N] x: (y, x + residual or None)", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("residual"), py::arg("eps"), py::arg("rms"), py::arg("zero_centered"),
        py::arg("x_data") = py::none(), py::arg("residual_data") = py::none());
  m.def("module_norm", &module_norm, "functional._norm where this path takes the call as it is, else None");
  m.def("add_spec", &add_spec, "Remember how a call signature's launches and allocations replay");
  m.def("set_callbacks", &set_callbacks, "The Python paths that run (and record) unknown signatures",
        py::arg("forward"), py::arg("backward"), py::arg("ready") = py::none());
  m.def("set_test_launcher", &set_test_launcher, "A Python callable in place of cuLaunchKernel (None: the driver)");
  m.def("clear", &clear, "Forget every recorded signature");
  m.def("size", &size, "Recorded signatures");
  m.def("set_capacity", &set_capacity, "How many signatures to remember");
  m.def("stats", &stats, "Calls replayed and calls the Python path ran, forward and backward, since import");
}
