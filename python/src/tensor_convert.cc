#include "tensor_convert.hpp"

#include <string>

#include "epcomm/error.hpp"

namespace epcomm {
namespace python {

DType dtypeFromDlpack(nb::dlpack::dtype dtype) {
  using Code = nb::dlpack::dtype_code;
  if (dtype.lanes != 1) return DType::kInvalid;
  switch (static_cast<Code>(dtype.code)) {
    case Code::Int:
      if (dtype.bits == 32) return DType::kI32;
      if (dtype.bits == 64) return DType::kI64;
      // int8 payloads are raw bytes to dispatch, the same as uint8.
      if (dtype.bits == 8) return DType::kU8;
      return DType::kInvalid;
    case Code::UInt:
      if (dtype.bits == 8) return DType::kU8;
      if (dtype.bits == 32) return DType::kU32;
      return DType::kInvalid;
    case Code::Float:
      if (dtype.bits == 16) return DType::kF16;
      if (dtype.bits == 32) return DType::kF32;
      return DType::kInvalid;
    case Code::Bfloat:
      return dtype.bits == 16 ? DType::kBf16 : DType::kInvalid;
    case Code::Float8_E4M3:
    case Code::Float8_E4M3FN:
      return dtype.bits == 8 ? DType::kFp8E4M3 : DType::kInvalid;
    case Code::Float8_E5M2:
      return dtype.bits == 8 ? DType::kFp8E5M2 : DType::kInvalid;
    default:
      return DType::kInvalid;
  }
}

namespace {

std::string describeDlpack(nb::dlpack::dtype dtype) {
  return "DLPack dtype (code " + std::to_string(dtype.code) + ", bits " + std::to_string(dtype.bits) + ", lanes " +
         std::to_string(dtype.lanes) + ")";
}

template <typename Array>
TensorView viewOf(const char* name, const Array& array, const std::string& dtypeOverride) {
  TensorView view;
  EPCOMM_CHECK(array.ndim() <= static_cast<size_t>(TensorView::kMaxDims), kInvalidArgument,
               name << " has " << array.ndim() << " dimensions, at most " << TensorView::kMaxDims << " are supported");
  const DType native = dtypeFromDlpack(array.dtype());
  const int nativeBytes = array.dtype().bits * array.dtype().lanes / 8;
  if (dtypeOverride.empty()) {
    EPCOMM_CHECK(native != DType::kInvalid, kInvalidArgument,
                 name << " has an unsupported " << describeDlpack(array.dtype())
                      << "; pass (array, \"bf16\") to reinterpret its elements");
    view.dtype = native;
  } else {
    view.dtype = dtypeFromName(dtypeOverride);
    EPCOMM_CHECK(dtypeSize(view.dtype) == nativeBytes, kInvalidArgument,
                 name << ": cannot reinterpret " << nativeBytes << "-byte elements as " << dtypeOverride << " ("
                      << dtypeSize(view.dtype) << " bytes)");
  }
  view.ndim = static_cast<int>(array.ndim());
  for (int d = 0; d < view.ndim; ++d) {
    view.shape[d] = static_cast<int64_t>(array.shape(d));
    view.strides[d] = array.stride(d);
  }
  view.data = const_cast<void*>(static_cast<const void*>(array.data()));
  switch (array.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      view.memory = MemoryKind::kHost;
      view.device = -1;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      view.memory = MemoryKind::kCuda;
      view.device = array.device_id();
      break;
    default:
      EPCOMM_THROW(kInvalidArgument, name << " lives on DLPack device type " << array.device_type()
                                          << "; epcomm accepts CPU and CUDA memory");
  }
  return view;
}

}  // namespace

TensorView toTensorView(const char* name, nb::handle obj, bool writable, bool optional, TensorHolder& holder) {
  if (obj.is_none()) {
    EPCOMM_CHECK(optional, kInvalidArgument, name << " is required but None was given");
    return TensorView{};
  }
  nb::handle arrayObj = obj;
  std::string dtypeOverride;
  if (nb::isinstance<nb::tuple>(obj)) {
    nb::tuple pair = nb::borrow<nb::tuple>(obj);
    EPCOMM_CHECK(pair.size() == 2 && nb::isinstance<nb::str>(pair[1]), kInvalidArgument,
                 name << " must be an array or an (array, \"dtype\") pair");
    arrayObj = pair[0];
    dtypeOverride = nb::cast<std::string>(pair[1]);
  }
  const std::string typeName = nb::cast<std::string>(nb::type_name(arrayObj.type()));
  if (writable) {
    nb::ndarray<> array;
    EPCOMM_CHECK(nb::try_cast(arrayObj, array, false), kInvalidArgument,
                 name << " (" << typeName
                      << ") is not a writable array: pass a tensor supporting __dlpack__ (torch, numpy, CuPy, JAX)");
    holder.writable.push_back(array);
    return viewOf(name, array, dtypeOverride);
  }
  nb::ndarray<nb::ro> array;
  EPCOMM_CHECK(nb::try_cast(arrayObj, array, false), kInvalidArgument,
               name << " (" << typeName << ") is not an array: pass a tensor supporting __dlpack__ (torch, numpy, "
                    << "CuPy, JAX)");
  holder.readOnly.push_back(array);
  return viewOf(name, array, dtypeOverride);
}

const int32_t* boundMPointer(nb::handle obj, const TensorView& peer, TensorHolder& holder) {
  if (obj.is_none()) return nullptr;
  TensorView view = toTensorView("bound_m", obj, false, false, holder);
  // pplx-kernels passes uint32; the backends read the same 32 bits as int32 (counts are < 2^31).
  EPCOMM_CHECK(view.dtype == DType::kI32 || view.dtype == DType::kU32, kInvalidArgument,
               "bound_m must be an int32 (or uint32) tensor, got " << dtypeName(view.dtype));
  EPCOMM_CHECK(view.numel() == 1, kInvalidArgument,
               "bound_m must hold exactly one element (0-d or shape [1]), got " << view.toString());
  EPCOMM_CHECK(!peer.defined() || (view.memory == peer.memory && view.device == peer.device), kInvalidArgument,
               "bound_m lives in " << view.toString() << " but the other tensors in " << peer.toString()
                                   << ": it must be in the same memory");
  return static_cast<const int32_t*>(view.data);
}

}  // namespace python
}  // namespace epcomm
