"""Measurement: `atomflow bench` and `atomflow profile`.

driver.py     `atomflow bench`: our engine, then each baseline, against one bandwidth measurement
plan.py       options and the tests they ask for (pp<P>, tg<N>, tg<N>@d<D>)
engine.py     our engine's timing loops
bandwidth.py  bytes a token must move, and the streaming-read ceiling they are measured against
result.py     one result: every sample, and the rows the report renders
report.py     markdown / JSON / CSV
profile.py    `atomflow profile`: the decode step broken down by kernel
baselines/    hf, torch-compile, torch-compile-int8, torch-fp8, vllm
"""
