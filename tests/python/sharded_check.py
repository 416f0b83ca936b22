"""Reads a sharded component of a torchpoint checkpoint as Hugging Face users read sharded
checkpoints, and checks it against the same tensors saved unsharded.

Usage: sharded_check.py CHECKPOINT COMPONENT REFERENCE.safetensors

1. Through the index with safetensors alone: CHECKPOINT/COMPONENT.safetensors.index.json's
   weight_map names each tensor's shard; every shard is opened with
   safetensors.torch.load_file; each must hold exactly the tensors the map gives it, and
   "total_size" must be the sum of their byte sizes.
2. With accelerate's loader of sharded checkpoints (accelerate.utils.load_checkpoint_in_model,
   given the index file), into a torch.nn.Module whose parameters have the reference's names,
   dtypes and shapes (zeros before the load).
3. When COMPONENT is "model" (whose index is the "model.safetensors.index.json" Hugging Face
   looks for): with transformers' load_sharded_checkpoint(module, CHECKPOINT), strict, into
   another such module.
All must give exactly REFERENCE's names, dtypes, shapes and bytes. Prints one line per problem
and exits 1 if there is any; prints "ok: ..." and exits 0 otherwise; exits 2 when the packages
cannot be imported.
"""
import json
import os
import sys

try:
    import torch
    from safetensors.torch import load_file
    from accelerate.utils import load_checkpoint_in_model
    from transformers.trainer_utils import load_sharded_checkpoint
except ImportError as e:
    print("cannot import torch, safetensors, accelerate and transformers (run with the project "
          "venv's "
          "python): %s" % e, file=sys.stderr)
    sys.exit(2)


def same(a, b):
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def compare(what, got, reference, problems):
    if set(got) != set(reference):
        problems.append("%s: tensors %s, expected %s" % (what, sorted(got), sorted(reference)))
        return
    for name, tensor in reference.items():
        if not same(got[name], tensor):
            problems.append("%s: tensor %s differs (%s %s vs %s %s)" % (
                what, name, got[name].dtype, tuple(got[name].shape), tensor.dtype,
                tuple(tensor.shape)))


def module_like(reference):
    """A module with one zero tensor per reference name, nested by the dotted parts."""
    root = torch.nn.Module()
    for name, tensor in reference.items():
        parts = name.split(".")
        module = root
        for part in parts[:-1]:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        zeros = torch.zeros(tensor.shape, dtype=tensor.dtype)
        if tensor.is_floating_point():
            module.register_parameter(parts[-1], torch.nn.Parameter(zeros, requires_grad=False))
        else:
            module.register_buffer(parts[-1], zeros)
    return root


def main():
    checkpoint, component, reference_path = sys.argv[1:4]
    reference = load_file(reference_path)
    problems = []

    index_path = os.path.join(checkpoint, component + ".safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    merged = {}
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        for name, tensor in load_file(os.path.join(checkpoint, shard)).items():
            if weight_map.get(name) != shard:
                problems.append("%s holds %s, which the weight map puts in %s" % (
                    shard, name, weight_map.get(name)))
            merged[name] = tensor
    total = sum(t.numel() * t.element_size() for t in merged.values())
    if index["metadata"]["total_size"] != total:
        problems.append("total_size is %s, the shards hold %d bytes" % (
            index["metadata"]["total_size"], total))
    compare("safetensors through the index", merged, reference, problems)

    model = module_like(reference)
    load_checkpoint_in_model(model, index_path)
    compare("accelerate's load_checkpoint_in_model", model.state_dict(), reference, problems)
    judges = "safetensors and accelerate"

    if component == "model":
        model = module_like(reference)
        keys = load_sharded_checkpoint(model, checkpoint, strict=True)
        if keys.missing_keys or keys.unexpected_keys:
            problems.append("transformers: missing %s, unexpected %s" % (
                keys.missing_keys, keys.unexpected_keys))
        compare("transformers' load_sharded_checkpoint", model.state_dict(), reference, problems)
        judges = "safetensors, accelerate and transformers"

    for p in problems:
        print(p)
    if problems:
        return 1
    print("ok: %d tensors from %d shards, with %s" % (len(merged), len(shards), judges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
