"""Single-device layers shared by the model families (imports only torch; never `parallelisms`).

One file per idea: rms_norm.py (RMSNorm, fused CPU backward), rope.py (rotary tables, Llama 3.1 and YaRN
scaling, both channel layouts), attention.py (grouped-query attention, optional QK-norm), split_causal.py (the
CPU causal-attention kernel path it takes at 257..512 tokens), documents.py (block-causal document attention)
with its torch-free mask names in mask_types.py, feed_forward.py (SwiGLU), moe.py (the mixture-of-experts layer)
with its torch-free arguments in moe_args.py, hf_names.py (our FQNs <-> Hugging Face's names, for every family's
adapter). A family's model.py composes them (docs/architecture.md §8).

This package module imports nothing, so a family's torch-free args (the pre-flight's flavors) can import
`models.common.moe_args` without torch: import the layers from their modules.
"""
