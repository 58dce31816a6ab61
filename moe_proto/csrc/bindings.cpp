// Python bindings of moe_proto's C++ CPU ops (moe_proto/ops.py builds this library); every call runs without the GIL.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("expert_ffn_forward", &expert_ffn_forward, py::call_guard<py::gil_scoped_release>());
  m.def("expert_ffn_backward", &expert_ffn_backward, py::call_guard<py::gil_scoped_release>());
  m.def("activation_with_derivative", &activation_with_derivative, py::call_guard<py::gil_scoped_release>());
  m.def("combine_backward", &combine_backward, py::call_guard<py::gil_scoped_release>());
  m.def("add_router_input_grad", &add_router_input_grad, py::arg("grad_x"), py::arg("grad_logits"), py::arg("w"),
        py::arg("out"), py::arg("route_row") = py::none(), py::arg("route_offsets") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("select_top1", &select_top1, py::call_guard<py::gil_scoped_release>());
  m.def("assign_slots", &assign_slots, py::call_guard<py::gil_scoped_release>());
}
