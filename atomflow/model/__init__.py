"""The model front: what a model is and how it gets into one file.

spec.py        ModelSpec, validated from a Hugging Face config.json (mirrored in include/atomflow/spec.h)
fileformat.py  the .atomflow file: reader (AtomflowFile) and streaming writer (docs/FORMAT.md)
quantize.py    Hugging Face directory -> .atomflow (FP8 weights, group scales)
download.py    `atomflow download`: a Hugging Face model into a directory, resumably
reference.py   the numpy fp32 forward pass: the CPU backend and the test oracle
recipe.py      the prefill recipes (w8a16, w8a8) a user picks
tokenizer.py   text <-> ids, the chat template, the streaming detokenizer
"""
