"""The prefill recipes a user picks (`--prefill-recipe`, Engine.load(prefill_recipe=)): how a prompt
chunk's products treat their activations. The weights are the file's FP8 either way.

  w8a16  the default: activations in 16 bits, FP8 weights converted exactly (the decode step's math)
  w8a8   the FP8 recipe: in chunks of at least W8A8_MIN_ROWS rows each product's input is quantized
         per token per 128 columns to e4m3 (scale = amax / 448) and multiplied on FP8 tensor cores
         (CUDA: PlanOptions::prefill_fp8, gemm_w8a8_sm90; the CPU reference emulates it). Decode steps
         are unchanged. Its cost in quality: docs/design/gemm_w8a8_sm90.md.
"""

PREFILL_RECIPES = ("w8a16", "w8a8")
W8A8_MIN_ROWS = 256  # StepPlan::kW8A8MinRows (include/atomflow/step_plan.h): the plan reports it
PREFILL_RECIPE_HELP = (
    "w8a16 (default) or w8a8: prompt chunks of 256+ rows with their activations quantized to FP8 per token "
    "per 128 columns (FP8 tensor cores, faster prompts, other bits; docs/design/gemm_w8a8_sm90.md)"
)
