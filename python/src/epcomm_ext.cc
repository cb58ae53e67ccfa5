// The nanobind module epcomm._C: a thin binding of the C++ API. Tensors arrive through DLPack (no torch headers,
// so one build serves every torch version and every framework); every epcomm::Error becomes epcomm.Error with the
// C++ message and its code. The user-facing API (argument checks, torch custom ops) lives in python/epcomm.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/environment.hpp"
#include "epcomm/epcomm.hpp"
#include "epcomm/plan.hpp"
#include "epcomm/reference.hpp"
#include "tensor_convert.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace epcomm {
namespace python {

namespace {

// The Python class epcomm.Error (a RuntimeError subclass). Created once at import; never freed (module lifetime).
PyObject* gErrorType = nullptr;

void raiseError(const Error& e) {
  nb::object exc = nb::steal(PyObject_CallFunction(gErrorType, "s", e.what()));
  if (!exc.is_valid()) return;  // The call set a Python error already.
  nb::setattr(exc, "code", nb::str(errorCodeName(e.code())));
  nb::setattr(exc, "message", nb::str(e.message().c_str()));
  nb::setattr(exc, "file", nb::str(e.file() != nullptr ? e.file() : ""));
  nb::setattr(exc, "line", nb::int_(e.line()));
  PyErr_SetObject(gErrorType, exc.ptr());
}

/// A Bootstrap whose collectives call back into a Python object with the methods
/// `all_gather(data: bytes) -> bytes` (world_size * len(data) bytes, rank order), `barrier() -> None` and
/// `broadcast(data: bytes, root: int) -> bytes`. Lets torch.distributed (or anything else) carry the rendezvous.
class PyCallbackBootstrap : public Bootstrap {
 public:
  PyCallbackBootstrap(nb::object impl, int rank, int worldSize)
      : impl_(std::move(impl)), rank_(rank), worldSize_(worldSize) {}
  ~PyCallbackBootstrap() override {
    nb::gil_scoped_acquire gil;
    impl_.reset();
  }

  int rank() const override { return rank_; }
  int worldSize() const override { return worldSize_; }

  void allGather(const void* send, void* recv, size_t bytes) override {
    // The backends may call from a thread that released the GIL.
    nb::gil_scoped_acquire gil;
    nb::bytes result = callBytes("all_gather", [&] { return impl_.attr("all_gather")(nb::bytes(send, bytes)); });
    EPCOMM_CHECK(result.size() == bytes * worldSize_, kBootstrap,
                 "python bootstrap all_gather returned " << result.size() << " bytes, expected " << bytes << " x "
                                                         << worldSize_);
    std::memcpy(recv, result.c_str(), result.size());
  }

  void barrier() override {
    nb::gil_scoped_acquire gil;
    try {
      impl_.attr("barrier")();
    } catch (nb::python_error& e) {
      EPCOMM_THROW(kBootstrap, "python bootstrap barrier failed on rank " << rank_ << ": " << e.what());
    }
  }

  void broadcast(void* data, size_t bytes, int root) override {
    nb::gil_scoped_acquire gil;
    nb::bytes result = callBytes("broadcast", [&] { return impl_.attr("broadcast")(nb::bytes(data, bytes), root); });
    EPCOMM_CHECK(result.size() == bytes, kBootstrap,
                 "python bootstrap broadcast returned " << result.size() << " bytes, expected " << bytes);
    std::memcpy(data, result.c_str(), bytes);
  }

 private:
  template <typename Fn>
  nb::bytes callBytes(const char* what, Fn fn) {
    nb::object out;
    try {
      out = fn();
    } catch (nb::python_error& e) {
      EPCOMM_THROW(kBootstrap, "python bootstrap " << what << " failed on rank " << rank_ << ": " << e.what());
    }
    EPCOMM_CHECK(
        nb::isinstance<nb::bytes>(out), kBootstrap,
        "python bootstrap " << what << " must return bytes, got " << nb::cast<std::string>(nb::type_name(out.type())));
    return nb::borrow<nb::bytes>(out);
  }

  nb::object impl_;
  int rank_;
  int worldSize_;
};

/// The Python-visible AllToAll. Holds the bootstrap's Python object so the bootstrap outlives the backend.
class PyAllToAll {
 public:
  PyAllToAll(std::unique_ptr<AllToAll> impl, nb::object bootstrap)
      : impl_(std::move(impl)), bootstrap_(std::move(bootstrap)) {}
  ~PyAllToAll() { close(); }

  AllToAll& get() {
    EPCOMM_CHECK(impl_ != nullptr, kInvalidArgument, "this AllToAll was destroyed (close() was called)");
    return *impl_;
  }

  void dispatch(nb::handle outExpertNumTokens, nb::handle outExpertX, nb::handle outExpertXScale, nb::handle x,
                nb::handle xScale, nb::handle indices, nb::handle boundM, bool doSend, bool doRecv, uintptr_t stream) {
    AllToAll& a2a = get();
    TensorHolder holder;
    DispatchArgs args;
    // Inputs the call does not use (send-side ones when doSend is false, and so on) may be None.
    args.outExpertNumTokens = toTensorView("out_expert_num_tokens", outExpertNumTokens, true, !doRecv, holder);
    args.outExpertX = toTensorView("out_expert_x", outExpertX, true, !doRecv, holder);
    args.outExpertXScale = toTensorView("out_expert_x_scale", outExpertXScale, true, true, holder);
    args.x = toTensorView("dp_x", x, false, !doSend, holder);
    args.xScale = toTensorView("dp_x_scale", xScale, false, true, holder);
    args.indices = toTensorView("indices", indices, false, !doSend, holder);
    args.boundM = boundMPointer(boundM, doSend ? args.x : args.outExpertX, holder);
    args.doSend = doSend;
    args.doRecv = doRecv;
    args.stream = reinterpret_cast<void*>(stream);
    nb::gil_scoped_release release;  // The host backend's receive half blocks.
    a2a.dispatch(args);
  }

  void combine(nb::handle outTokens, nb::handle indices, nb::handle weights, nb::handle expertY, nb::handle boundM,
               bool doSend, bool doRecv, bool accumulate, uintptr_t stream) {
    AllToAll& a2a = get();
    TensorHolder holder;
    CombineArgs args;
    args.outTokens = toTensorView("out_tokens", outTokens, true, !doRecv, holder);
    args.indices = toTensorView("indices", indices, false, !doRecv, holder);
    args.weights = toTensorView("weights", weights, false, !doRecv, holder);
    args.expertY = toTensorView("expert_y", expertY, false, !doSend, holder);
    args.boundM = boundMPointer(boundM, doRecv ? args.outTokens : args.expertY, holder);
    args.doSend = doSend;
    args.doRecv = doRecv;
    args.accumulate = accumulate;
    args.stream = reinterpret_cast<void*>(stream);
    nb::gil_scoped_release release;
    a2a.combine(args);
  }

  void synchronize() {
    AllToAll& a2a = get();
    nb::gil_scoped_release release;
    a2a.synchronize();
  }

  /// Elastic ranks (AllToAll::setActiveRanks): collective, blocks until the ranks agree.
  void setActiveRanks(const std::vector<int32_t>& mask) {
    AllToAll& a2a = get();
    nb::gil_scoped_release release;
    a2a.setActiveRanks(mask);
  }

  /// Destroys the backend object (collective on some backends); later calls raise. Idempotent.
  void close() {
    if (impl_ != nullptr) {
      std::unique_ptr<AllToAll> impl = std::move(impl_);
      // Destruction may join progress threads; they never need the GIL, but a Python bootstrap does.
      nb::gil_scoped_release release;
      impl.reset();
    }
    bootstrap_.reset();
  }

  bool closed() const { return impl_ == nullptr; }

 private:
  std::unique_ptr<AllToAll> impl_;
  nb::object bootstrap_;
};

/// Holds a Bootstrap for Python; the callback flavour keeps its Python object through PyCallbackBootstrap.
struct PyBootstrap {
  std::unique_ptr<Bootstrap> impl;
  Bootstrap& get() {
    EPCOMM_CHECK(impl != nullptr, kInvalidArgument, "bootstrap is not initialised");
    return *impl;
  }
};

// Reads the reference's per-rank arguments from a dict: keys as in the Python dispatch() signature.
nb::object item(const nb::dict& d, const char* key) { return d.contains(key) ? nb::object(d[key]) : nb::none(); }

void referenceDispatch(const Config& config, const std::vector<nb::dict>& ranks,
                       const std::vector<int32_t>& activeRanks) {
  EPCOMM_CHECK(
      ranks.size() == config.worldSize, kInvalidArgument,
      "reference_dispatch needs one dict per rank: got " << ranks.size() << ", worldSize = " << config.worldSize);
  TensorHolder holder;
  std::vector<DispatchArgs> args(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    const nb::dict& d = ranks[r];
    DispatchArgs& a = args[r];
    a.outExpertNumTokens = toTensorView("out_expert_num_tokens", item(d, "out_expert_num_tokens"), true, false, holder);
    a.outExpertX = toTensorView("out_expert_x", item(d, "out_expert_x"), true, false, holder);
    a.outExpertXScale = toTensorView("out_expert_x_scale", item(d, "out_expert_x_scale"), true, true, holder);
    a.x = toTensorView("dp_x", item(d, "dp_x"), false, false, holder);
    a.xScale = toTensorView("dp_x_scale", item(d, "dp_x_scale"), false, true, holder);
    a.indices = toTensorView("indices", item(d, "indices"), false, false, holder);
    a.boundM = boundMPointer(item(d, "bound_m"), a.x, holder);
  }
  nb::gil_scoped_release release;
  if (activeRanks.empty()) {
    reference::dispatch(config, args);
  } else {
    reference::dispatch(config, args, activeRanks);
  }
}

void referenceCombine(const Config& config, const std::vector<nb::dict>& ranks,
                      const std::vector<int32_t>& activeRanks) {
  EPCOMM_CHECK(
      ranks.size() == config.worldSize, kInvalidArgument,
      "reference_combine needs one dict per rank: got " << ranks.size() << ", worldSize = " << config.worldSize);
  TensorHolder holder;
  std::vector<CombineArgs> args(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    const nb::dict& d = ranks[r];
    CombineArgs& a = args[r];
    a.outTokens = toTensorView("out_tokens", item(d, "out_tokens"), true, false, holder);
    a.indices = toTensorView("indices", item(d, "indices"), false, false, holder);
    a.weights = toTensorView("weights", item(d, "weights"), false, false, holder);
    a.expertY = toTensorView("expert_y", item(d, "expert_y"), false, false, holder);
    a.boundM = boundMPointer(item(d, "bound_m"), a.outTokens, holder);
    a.accumulate = d.contains("accumulate") && nb::cast<bool>(d["accumulate"]);
  }
  nb::gil_scoped_release release;
  if (activeRanks.empty()) {
    reference::combine(config, args);
  } else {
    reference::combine(config, args, activeRanks);
  }
}

Layout layoutFromName(const std::string& name) {
  if (name == "batched") return Layout::kBatched;
  if (name == "packed") return Layout::kPacked;
  EPCOMM_THROW(kInvalidArgument, "unknown layout '" << name << "' (batched, packed)");
}

DispatchCast dispatchCastFromName(const std::string& name) {
  for (DispatchCast c : {DispatchCast::kNone, DispatchCast::kFp8Blocks, DispatchCast::kFp8BlocksPow2}) {
    if (name == dispatchCastName(c)) return c;
  }
  EPCOMM_THROW(kInvalidArgument, "unknown dispatch_cast '" << name << "' (none, fp8_blocks, fp8_blocks_pow2)");
}

}  // namespace

}  // namespace python
}  // namespace epcomm

NB_MODULE(_C, m) {
  using namespace epcomm;
  using namespace epcomm::python;
  m.doc() = "epcomm C++ bindings (use the `epcomm` package, not this module directly)";
  // torch.compile's caches keep AllToAll objects and bound methods alive until the interpreter is torn down, which
  // nanobind would report at exit as leaks (pages of "leaked function" lines) although nothing is lost.
  nb::set_leak_warnings(false);

  nb::dict errorDefaults;
  errorDefaults["code"] = nb::str("internal");
  errorDefaults["message"] = nb::str("");
  errorDefaults["file"] = nb::str("");
  errorDefaults["line"] = nb::int_(0);
  gErrorType = PyErr_NewExceptionWithDoc(
      "epcomm.Error",
      "An epcomm failure. `code` is the stable error name ('invalid_argument', 'timeout', ...); str() is the C++ "
      "message with its code and throw site.",
      PyExc_RuntimeError, errorDefaults.ptr());
  m.attr("Error") = nb::handle(gErrorType);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      raiseError(e);
    }
  });

  m.def("version", &versionString, "The library version, e.g. '0.1.0'.");
  m.def("built_backends", &builtBackends, "Backends this build contains, in preference order.");
  m.def(
      "error_code_names",
      [] {
        std::vector<std::string> names;
        for (int c = static_cast<int>(ErrorCode::kInvalidArgument); c <= static_cast<int>(ErrorCode::kInternal); ++c)
          names.emplace_back(errorCodeName(static_cast<ErrorCode>(c)));
        return names;
      },
      "Every Error.code value.");
  m.def(
      "env_vars",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (const EnvironmentVariable& v : environmentVariables())
          out.emplace_back(v.name, v.defaultValue, v.description);
        return out;
      },
      "Every EPCOMM_* environment variable as (name, default, description).");
  m.def(
      "dtype_size", [](const std::string& name) { return dtypeSize(dtypeFromName(name)); }, "name"_a,
      "Bytes per element of an epcomm dtype name ('bf16', 'fp8_e4m3', ...).");

  nb::enum_<Layout>(m, "Layout", "Layout of out_expert_x / expert_y.")
      .value("batched", Layout::kBatched, "[L, max_num_tokens * W / D (padded), ...] (pplx-kernels)")
      .value("packed", Layout::kPacked, "[sum of padded counts, ...]");
  m.def("layout_from_name", &layoutFromName, "name"_a);

  nb::enum_<DispatchCast>(m, "DispatchCast", "A cast the dispatch applies to each token (Config.dispatch_cast).")
      .value("none", DispatchCast::kNone, "x's bytes travel as they are")
      .value("fp8_blocks", DispatchCast::kFp8Blocks,
             "x bf16 [m, H] arrives as fp8 e4m3 [H] + fp32 scales [H / 128] (DeepEP's cast, inside the dispatch)")
      .value("fp8_blocks_pow2", DispatchCast::kFp8BlocksPow2, "fp8_blocks with power-of-two scales (round_scale)");
  m.def("dispatch_cast_from_name", &dispatchCastFromName, "name"_a);
  m.def("dispatch_cast_backends", &dispatchCastBackends,
        "Backends whose dispatch applies Config.dispatch_cast (the others refuse it with code 'unavailable').");

  nb::class_<Config>(m, "Config", "Everything that sizes an AllToAll object (plain data; validate() checks it).")
      .def(nb::init<>())
      .def_rw("max_num_tokens", &Config::maxNumTokens, "Max tokens per rank per call.")
      .def_rw("num_experts", &Config::numExperts, "E, total experts over all ranks.")
      .def_rw("experts_per_token", &Config::expertsPerToken, "K, the router's top-k.")
      .def_rw("world_size", &Config::worldSize, "W, number of ranks.")
      .def_rw("rank", &Config::rank, "This rank, in [0, W).")
      .def_rw("dp_size", &Config::dpSize, "D, ranks per DP group (W % D == 0).")
      .def_rw("hidden_dim", &Config::hiddenDim, "H, elements per token of the combine.")
      .def_rw("hidden_dim_bytes", &Config::hiddenDimBytes, "Dispatch payload bytes per token (multiple of 16).")
      .def_rw("hidden_dim_scale_bytes", &Config::hiddenDimScaleBytes, "Dispatch scale bytes per token (0 = none).")
      .def_rw("expert_padding", &Config::expertPadding, "Row alignment of each expert's segment (power of two).")
      .def_rw("layout", &Config::layout, "Layout of out_expert_x / expert_y.")
      .def_rw("dispatch_cast", &Config::dispatchCast,
              "Cast the dispatch applies to each token: none, fp8_blocks, fp8_blocks_pow2 (epcomm.DispatchCast).")
      .def("validate", &Config::validate, "Raises epcomm.Error(code='invalid_config') naming the first bad field.")
      .def_prop_ro("num_local_experts", &Config::numLocalExperts, "L = E / W.")
      .def_prop_ro("num_dp_groups", &Config::numDpGroups, "G = W / D.")
      .def_prop_ro("dp_group", &Config::dpGroup, "This rank's DP group.")
      .def_prop_ro("batched_rows_per_expert", &Config::batchedRowsPerExpert,
                   "Rows per expert of the batched layout: max_num_tokens * G rounded up to expert_padding.")
      .def_prop_ro("packed_rows", &Config::packedRows, "Rows of the packed layout.")
      .def_prop_ro("expert_rows", &Config::expertRows, "Rows of out_expert_x in the configured layout.")
      .def("__repr__", [](const Config& c) { return "Config(" + c.toString() + ")"; });

  m.def("standard_config", &standardConfig, "name"_a, "world_size"_a, "rank"_a = 0, "dp_size"_a = 1,
        "The standard configuration `name` (decode, prefill, small, qwen3) for world_size ranks.");
  m.def(
      "standard_config_names",
      [] {
        int count = 0;
        const char* const* names = standardConfigNames(&count);
        return std::vector<std::string>(names, names + count);
      },
      "Names accepted by standard_config.");

  nb::class_<PlannedBuffer>(m, "PlannedBuffer", "One buffer of a memory plan.")
      .def_ro("owner", &PlannedBuffer::owner, "'outputs' (caller-allocated) or the backend name.")
      .def_ro("name", &PlannedBuffer::name)
      .def_ro("memory", &PlannedBuffer::memory, "'device', 'host pinned', 'host', ...")
      .def_ro("bytes", &PlannedBuffer::bytes)
      .def_ro("note", &PlannedBuffer::note, "Shape or formula.")
      .def("__repr__", [](const PlannedBuffer& b) {
        return "PlannedBuffer(" + b.owner + ", " + b.name + ", " + b.memory + ", " + std::to_string(b.bytes) +
               " bytes, " + b.note + ")";
      });
  m.def("plan_buffers", &planBuffers, "config"_a, "backend"_a,
        "Every buffer `config` needs on `backend` ('' = outputs only); allocates nothing.");
  m.def("format_plan", &formatPlan, "config"_a, "backend"_a, "plan"_a, "The plan as a printed table.");

  nb::class_<PyBootstrap>(m, "Bootstrap", "An out-of-band rendezvous between the ranks (used at setup only).")
      .def_prop_ro("rank", [](PyBootstrap& b) { return b.get().rank(); })
      .def_prop_ro("world_size", [](PyBootstrap& b) { return b.get().worldSize(); })
      .def(
          "barrier",
          [](PyBootstrap& b) {
            Bootstrap& impl = b.get();
            nb::gil_scoped_release release;
            impl.barrier();
          },
          "Returns when every rank has entered (collective).")
      .def(
          "all_gather",
          [](PyBootstrap& b, nb::bytes data) {
            Bootstrap& impl = b.get();
            std::string send(data.c_str(), data.size());
            std::string recv(send.size() * impl.worldSize(), '\0');
            {
              nb::gil_scoped_release release;
              impl.allGather(send.data(), recv.data(), send.size());
            }
            return nb::bytes(recv.data(), recv.size());
          },
          "data"_a, "Every rank's `data` (same length everywhere) concatenated in rank order (collective).")
      .def(
          "broadcast",
          [](PyBootstrap& b, nb::bytes data, int root) {
            Bootstrap& impl = b.get();
            std::string buf(data.c_str(), data.size());
            {
              nb::gil_scoped_release release;
              impl.broadcast(buf.data(), buf.size(), root);
            }
            return nb::bytes(buf.data(), buf.size());
          },
          "data"_a, "root"_a, "`root`'s data on every rank (same length everywhere; collective).");

  m.def(
      "tcp_bootstrap",
      [](const std::string& hostPort, int rank, int worldSize, int64_t timeoutMs) {
        auto b = std::make_unique<PyBootstrap>();
        nb::gil_scoped_release release;  // Waits for the other ranks.
        b->impl = createTcpBootstrap(hostPort, rank, worldSize, timeoutMs);
        return b;
      },
      "host_port"_a, "rank"_a, "world_size"_a, "timeout_ms"_a = 0,
      "TCP rendezvous: rank 0 listens on host:port, the others connect (collective, blocks).");
  m.def(
      "env_bootstrap",
      [] {
        auto b = std::make_unique<PyBootstrap>();
        nb::gil_scoped_release release;
        b->impl = createBootstrapFromEnv();
        return b;
      },
      "TCP rendezvous from EPCOMM_BOOTSTRAP, EPCOMM_RANK and EPCOMM_WORLD_SIZE.");
  m.def(
      "self_bootstrap",
      [] {
        auto b = std::make_unique<PyBootstrap>();
        b->impl = createSelfBootstrap();
        return b;
      },
      "A bootstrap for one rank alone.");
  m.def(
      "callback_bootstrap",
      [](nb::object impl, int rank, int worldSize) {
        EPCOMM_CHECK(worldSize > 0 && rank >= 0 && rank < worldSize, kInvalidArgument,
                     "callback_bootstrap: rank " << rank << " is out of range for world_size " << worldSize);
        for (const char* method : {"all_gather", "barrier", "broadcast"}) {
          EPCOMM_CHECK(nb::hasattr(impl, method), kInvalidArgument,
                       "callback_bootstrap: the object has no method '" << method << "'");
        }
        auto b = std::make_unique<PyBootstrap>();
        b->impl = std::make_unique<PyCallbackBootstrap>(std::move(impl), rank, worldSize);
        return b;
      },
      "impl"_a, "rank"_a, "world_size"_a,
      "A bootstrap whose collectives call impl.all_gather(bytes) -> bytes, impl.barrier(), "
      "impl.broadcast(bytes, root) -> bytes.");

  nb::class_<PyAllToAll>(m, "AllToAll", "Low-level AllToAll (see epcomm.AllToAll for the checked API).")
      .def("dispatch", &PyAllToAll::dispatch, "out_expert_num_tokens"_a.none(), "out_expert_x"_a.none(),
           "out_expert_x_scale"_a.none(), "dp_x"_a.none(), "dp_x_scale"_a.none(), "indices"_a.none(),
           "bound_m"_a.none() = nb::none(), "do_send"_a = true, "do_recv"_a = true, "stream"_a = 0,
           "Dispatch; tensors through DLPack, stream = cudaStream_t as int. Releases the GIL.")
      .def("combine", &PyAllToAll::combine, "out_tokens"_a.none(), "indices"_a.none(), "weights"_a.none(),
           "expert_y"_a.none(), "bound_m"_a.none() = nb::none(), "do_send"_a = true, "do_recv"_a = true,
           "accumulate"_a = false, "stream"_a = 0, "Combine; see dispatch.")
      .def("synchronize", &PyAllToAll::synchronize, "Waits for outstanding work and rethrows recorded errors.")
      .def("close", &PyAllToAll::close, "Destroys the backend object; later calls raise.")
      .def_prop_ro("closed", &PyAllToAll::closed)
      .def_prop_ro("config", [](PyAllToAll& a) { return a.get().config(); })
      .def_prop_ro("backend_name", [](PyAllToAll& a) { return std::string(a.get().backendName()); })
      .def_prop_ro("buffer_bytes", [](PyAllToAll& a) { return a.get().bufferBytes(); })
      .def_prop_ro(
          "active_ranks", [](PyAllToAll& a) { return a.get().activeRanks(); },
          "Elastic ranks: world_size entries, 1 = active, 0 = masked (kUnavailable on backends without them).")
      .def("set_active_ranks", &PyAllToAll::setActiveRanks, "mask"_a,
           "Masks ranks (collective over the active ranks, between rounds). Releases the GIL.")
      .def_prop_ro(
          "dropped_tokens", [](PyAllToAll& a) { return a.get().droppedTokens(); },
          "Combine positions left out because their rank was masked, since creation.");

  m.def(
      "create_all_to_all",
      [](const Config& config, nb::object bootstrap, const std::string& backend) {
        PyBootstrap& b = nb::cast<PyBootstrap&>(bootstrap);
        Bootstrap& impl = b.get();
        std::unique_ptr<AllToAll> a2a;
        {
          nb::gil_scoped_release release;  // Collective: waits for every rank.
          a2a = createAllToAll(config, impl, backend);
        }
        return std::make_unique<PyAllToAll>(std::move(a2a), std::move(bootstrap));
      },
      "config"_a, "bootstrap"_a, "backend"_a = "auto",
      "Creates an AllToAll on `backend` (collective over the bootstrap).");

  m.def("reference_dispatch", &referenceDispatch, "config"_a, "ranks"_a, "active_ranks"_a = std::vector<int32_t>(),
        "CPU reference dispatch for every rank: ranks[r] is a dict with rank r's host arrays under the names of "
        "AllToAll.dispatch (out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices, "
        "bound_m). Writes the outputs. active_ranks (elastic ranks, world_size entries of 0 / 1): positions routed "
        "to a masked rank, or sent by one, are dropped.");
  m.def(
      "cast_fp8_blocks",
      [](nb::handle x, nb::handle out, nb::handle scales, int blockSize, bool roundScale) {
        TensorHolder holder;
        const TensorView xv = toTensorView("x", x, false, false, holder);
        const TensorView ov = toTensorView("out", out, true, false, holder);
        const TensorView sv = toTensorView("scales", scales, true, false, holder);
        nb::gil_scoped_release release;
        reference::castFp8Blocks(xv, ov, sv, blockSize, roundScale);
      },
      "x"_a, "out"_a, "scales"_a, "block_size"_a = 128, "round_scale"_a = false,
      "The per-block fp8 e4m3 cast on the CPU (host arrays): out = fp8(x * 448 / amax), scales = amax / 448 per "
      "block of block_size elements of a row (amax >= 1e-4). See epcomm/reference.hpp.");
  m.def("reference_combine", &referenceCombine, "config"_a, "ranks"_a, "active_ranks"_a = std::vector<int32_t>(),
        "CPU reference combine for every rank: ranks[r] holds out_tokens, indices, weights, expert_y, bound_m and "
        "accumulate (bool). Writes out_tokens. active_ranks: as reference_dispatch's (dropped terms, weights not "
        "renormalised).");
}
