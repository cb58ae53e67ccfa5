// DLPack -> epcomm::TensorView for the Python bindings. Any object with __dlpack__ (torch, numpy, CuPy, JAX) or
// the buffer protocol is accepted; nothing is copied: the view aliases the caller's memory.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <vector>

#include "epcomm/tensor.hpp"

namespace epcomm {
namespace python {

namespace nb = nanobind;

/// Keeps the imported DLPack tensors alive for the duration of one call (the views point into them).
struct TensorHolder {
  std::vector<nb::ndarray<>> writable;
  std::vector<nb::ndarray<nb::ro>> readOnly;
};

/// Maps a DLPack dtype to an epcomm DType; returns kInvalid for types epcomm does not move (complex, int16, ...).
DType dtypeFromDlpack(nb::dlpack::dtype dtype);

/// Converts `obj` (an array, or a `(array, "dtype name")` tuple that reinterprets the elements, e.g. numpy
/// uint16 as bf16) into a view. `name` is the argument name used in error messages. None gives an empty view
/// when `optional`, an error otherwise. `writable`: the call writes through the view (outputs). Throws
/// epcomm::Error(kInvalidArgument) naming the argument.
TensorView toTensorView(const char* name, nb::handle obj, bool writable, bool optional, TensorHolder& holder);

/// The int32 scalar behind an optional bound_m argument (0-d or one-element int32 tensor), or nullptr for None.
/// It must live in the same memory (host, or the same CUDA device) as `peer`, another tensor of the call: the
/// backend dereferences it there.
const int32_t* boundMPointer(nb::handle obj, const TensorView& peer, TensorHolder& holder);

}  // namespace python
}  // namespace epcomm
