// Argument checks shared by the pybind11 modules (_core's ops harness, _sandbox): numpy arrays are
// taken as they are (no copy, no cast) and anything else is a ValueError naming the argument.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace atomflow::bindings {

namespace py = pybind11;

template <class T>
const char* dtype_name();
template <>
inline const char* dtype_name<float>() {
  return "float32";
}
template <>
inline const char* dtype_name<uint16_t>() {
  return "uint16 (bf16 or fp16 bit patterns)";
}
template <>
inline const char* dtype_name<uint8_t>() {
  return "uint8 (fp8 e4m3 bytes)";
}
template <>
inline const char* dtype_name<int32_t>() {
  return "int32";
}
template <>
inline const char* dtype_name<uint64_t>() {
  return "uint64";
}

inline std::string shape_str(const std::vector<py::ssize_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + (s[i] < 0 ? std::string("*") : std::to_string(s[i]));
  return out + (s.size() == 1 ? ",)" : ")");
}

// The array itself (no copy, no cast): exact dtype, C-contiguous, the expected shape (-1 = any).
template <class T>
py::array_t<T> arg(const py::array& a, const char* name, const std::vector<py::ssize_t>& shape) {
  if (!py::isinstance<py::array_t<T>>(a))
    throw py::value_error(std::string(name) + " must have dtype " + dtype_name<T>() + ", got " +
                          std::string(py::str(a.dtype())));
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be C-contiguous");
  std::vector<py::ssize_t> got(a.shape(), a.shape() + a.ndim());
  bool ok = got.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == got[i];
  if (!ok) throw py::value_error(std::string(name) + " has shape " + shape_str(got) + ", expected " + shape_str(shape));
  return py::reinterpret_borrow<py::array_t<T>>(a);
}

inline void require(bool cond, const std::string& msg) {
  if (!cond) throw py::value_error(msg);
}

}  // namespace atomflow::bindings
