// The step plan for Python (include/atomflow/step_plan.h): PlanOptions from keyword arguments, and
// the plan as a dict of rows, the form `atomflow info MODEL --plan [--json]` prints.
#pragma once
#include <pybind11/pybind11.h>

#include "atomflow/step_plan.h"

namespace atomflow::bindings {

// {"device": {...}, "options": {...}, "max_context", "activations", "graphs": [...],
//  "products": [one dict per GEMV launch], "attention": [one dict per attention grid]}
pybind11::dict plan_to_dict(const StepPlan& plan);

void register_plan(pybind11::module_& m);  // _core.plan_for

}  // namespace atomflow::bindings
