"""``jaxdist/inspect/wire.py``: a collective's groups, mesh axes and wire bytes, from each way XLA prints them."""

from __future__ import annotations

import pytest

from jaxdist.inspect.wire import device_groups, group_size, spanned_axes, wire_bytes

MESH = {"data": 2, "fsdp": 2, "tensor": 2}  # partition i sits at unravel_index(i, (2, 2, 2))


@pytest.mark.parametrize(
    "attributes, groups",
    [
        ("channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add", [[0, 1], [2, 3]]),
        ("replica_groups=[2,4]<=[8], dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        # Shardy's mesh form, as jaxlib 0.10 prints it: groups vary along the listed axes
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0'}, use_global_device_ids=true", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1','axis_2'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # device_ids: the mesh's devices are iota(8).reshape(2,4).T in mesh order
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", [[0, 2], [4, 6], [1, 3], [5, 7]]),
        ("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", [[0, 1], [1, 2], [2, 3], [3, 0]]),
        ("replica_groups={}, to_apply=%add", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ("to_apply=%add", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ],
)
def test_groups_from_every_printed_form(attributes: str, groups: list[list[int]]) -> None:
    assert device_groups(attributes, 8) == groups


def test_no_groups_and_no_device_count_is_unknown() -> None:
    assert device_groups("to_apply=%add", None) is None
    assert wire_bytes("all-reduce", 1000, None) is None


def test_axes_follow_mesh_coordinates() -> None:
    assert spanned_axes([[0, 4], [1, 5]], MESH) == ("data",)
    assert spanned_axes([[0, 1, 2, 3]], MESH) == ("fsdp", "tensor")
    assert spanned_axes([[0, 2], [1, 3]], MESH) == ("fsdp",)
    assert spanned_axes([[0], [1]], MESH) == ()
    assert spanned_axes([[0, 1]], None) is None


def test_ring_formulas() -> None:
    assert wire_bytes("all-reduce", 800, 8) == 1400  # 2 x 7/8
    assert wire_bytes("all-gather", 800, 8) == 700 == wire_bytes("reduce-scatter", 800, 8) == wire_bytes("all-to-all", 800, 8)
    assert wire_bytes("all-reduce", 800, 1) == 0  # a group of one moves nothing
    assert wire_bytes("collective-permute", 800, None) == 800 == wire_bytes("send", 800, None)
    assert wire_bytes("recv", 800, None) == 0
    assert group_size("collective-permute", [[0, 1], [1, 0]]) == 2
    assert group_size("all-reduce", [[0, 1, 2, 3], [4, 5, 6, 7]]) == 4
