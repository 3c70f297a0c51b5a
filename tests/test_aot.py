"""pipelines.aot's reading of compiled HLO text: where a program's bytes live (HBM or the
chip's VMEM), on a hand-written module in the TPU compiler's notation (the compiled programs
themselves are in test_tpu.py)."""

# ruff: noqa: E501 (the compiler's HLO lines are long)
from __future__ import annotations

import pytest

from pipelines import aot

# f32[256,128] = 128 KiB; bf16[256,128] = 64 KiB; S(1): VMEM
HLO = """HloModule jit_program, entry_computation_layout={(f32[256,128]{1,0})->f32[256,128]{1,0}}

%fused_computation (param_0: f32[256,128]) -> f32[256,128] {
  %param_0 = f32[256,128]{1,0} parameter(0)
  ROOT %exponential.1 = f32[256,128]{1,0} exponential(%param_0)
}

%body (p: (s32[], f32[256,128])) -> (s32[], f32[256,128]) {
  %p = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) parameter(0)
  %gte.0 = s32[]{:T(128)} get-tuple-element(%p), index=0
  %gte.1 = f32[256,128]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %fusion.2 = f32[256,128]{1,0:T(8,128)S(1)} fusion(%gte.1), kind=kLoop, calls=%fused_computation
  %copy.3 = f32[256,128]{1,0:T(8,128)} copy(%fusion.2)
  ROOT %tuple.4 = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) tuple(%gte.0, %copy.3)
}

%cond (p.1: (s32[], f32[256,128])) -> pred[] {
  %p.1 = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) parameter(0)
  ROOT %c = pred[]{:T(128)} constant(false)
}

ENTRY %main (x: f32[256,128], y: bf16[256,128]) -> f32[256,128] {
  %x = f32[256,128]{1,0:T(8,128)} parameter(0)
  %y = bf16[256,128]{1,0:T(8,128)(2,1)} parameter(1)
  %copy-start = (bf16[256,128]{1,0:T(8,128)(2,1)S(1)}, bf16[256,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%y)
  %copy-done = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %slice-start = ((bf16[256,128]{1,0:T(8,128)(2,1)}), bf16[128,128]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%y), slice={[0:128], [0:128]}
  %slice-done = bf16[128,128]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start)
  %zero = s32[]{:T(128)} constant(0)
  %t = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) tuple(%zero, %x)
  %while.5 = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) while(%t), condition=%cond, body=%body
  ROOT %out = f32[256,128]{1,0:T(8,128)} get-tuple-element(%while.5), index=1
}
"""
KIB = 1024


def test_bytes_are_split_by_memory_space():
    got = aot.memory_traffic(HLO)
    # the loop body once: the fusion reads 128 KiB from HBM and writes 128 KiB to VMEM; the
    # copy reads those 128 KiB from VMEM and writes 128 KiB to HBM; the async copy moves
    # 64 KiB from HBM into VMEM and the async slice 32 KiB; the fused exponential (inside its
    # fusion) and the tuples, parameters and loop plumbing move nothing of their own
    assert got == {"hbm": 128 * KIB + 128 * KIB + 64 * KIB + 32 * KIB,
                   "on_chip": 256 * KIB + 64 * KIB + 32 * KIB}


def test_a_program_without_an_entry_counts_nothing():
    assert aot.memory_traffic("HloModule empty\n") == {"hbm": 0.0, "on_chip": 0.0}


@pytest.mark.parametrize("text, want", [("bf16[2,3]{1,0}", [(12, 0)]),
                                        ("(f32[4]{0:T(128)S(1)}, s8[8]{0})", [(16, 1), (8, 0)])])
def test_array_shapes_and_spaces(text, want):
    assert aot._arrays(text) == want


def test_one_collective_copied_into_several_computations_counts_once():
    """The TPU compiler's async collective fusions copy one all-gather (one channel_id) into
    several computations; an async pair is one collective; two channels are two; a
    collective without a channel id counts per instruction."""
    text = """
%async_collective_fusion.1 (param_0.1: f32[1,77,64]) -> f32[4,77,64] {
  %all-gather.1 = f32[4,77,64]{1,2,0:T(8,128)S(1)} all-gather(%param_0.1), channel_id=58, replica_groups=[1,4]<=[4], dimensions={0}
}
%async_collective_fusion.2 (param_0.2: f32[1,77,64]) -> f32[4,77,64] {
  %all-gather.2 = f32[4,77,64]{1,2,0:T(8,128)S(1)} all-gather(%param_0.2), channel_id=58, replica_groups=[1,4]<=[4], dimensions={0}
}
ENTRY %main (p: f32[1,77,64], q: s32[1]) -> f32[4,77,64] {
  %all-gather.3 = f32[4,77,64]{1,2,0:T(8,128)} all-gather(%p), channel_id=59, replica_groups=[1,4]<=[4], dimensions={0}
  %collective-permute-start.6 = (s32[1]{0:T(128)}, s32[1]{0:T(128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%q), channel_id=128, source_target_pairs={{1,0},{2,1},{3,2}}
  %collective-permute-done.6 = s32[1]{0:T(128)} collective-permute-done(%collective-permute-start.6)
  %all-reduce.7 = u32[] all-reduce(%r), to_apply=%add
  %all-reduce.8 = u32[] all-reduce(%s), to_apply=%add
}
"""
    assert aot.collectives(text) == {"all-gather": 2, "collective-permute": 1, "all-reduce": 2}
