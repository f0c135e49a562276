"""The launcher's view of a process (monai_cache/launcher.py): torchrun's variables first, Slurm's where torchrun's
are not set (a task that ``srun`` started, as Lightning's ``SLURMEnvironment`` leaves it), and Slurm's tasks per node
parsed exactly. Pure functions of a mapping: no process, no Slurm.
"""

from __future__ import annotations

import re

import pytest
from helpers import slurm_task

from monai_cache.launcher import TORCHRUN, launch_view, parse_tasks_per_node, tasks_on_node

TORCHRUN_3_OF_4 = {"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_RANK": "1"}


@pytest.mark.parametrize(
    "value, runs",
    [
        ("4", [(4, 1)]),
        ("2(x3)", [(2, 3)]),
        ("4,2(x2)", [(4, 1), (2, 2)]),
        ("2(x3),1", [(2, 3), (1, 1)]),
        ("1(x1)", [(1, 1)]),
        ("8(x128),7", [(8, 128), (7, 1)]),
        (" 4,2(x2)\n", [(4, 1), (2, 2)]),  # around the whole value only
    ],
)
def test_tasks_per_node_is_parsed_exactly(value, runs):
    assert parse_tasks_per_node(value) == runs


@pytest.mark.parametrize(
    "value",
    ["", ",", "4,", ",4", "x", "4x2", "2(3)", "2(x)", "(x2)", "2(x3", "2x3)", "2(x3)(x2)", "2(x-1)", "-1", "4, 2",
     "2 (x3)", "0", "2(x0)", "\u0663", "4.0", "2(X3)"],
)  # fmt: skip
def test_malformed_tasks_per_node_is_a_value_error_naming_the_variable(value):
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE="):
        parse_tasks_per_node(value, "SLURM_STEP_TASKS_PER_NODE")


@pytest.mark.parametrize(
    "value, node, count",
    [("4,2(x2)", 0, 4), ("4,2(x2)", 1, 2), ("4,2(x2)", 2, 2), ("1(x2),3", 2, 3), ("2(x3)", None, 2), ("5", None, 5),
     ("2(x3)", 2, 2)],
)  # fmt: skip
def test_tasks_on_a_node(value, node, count):
    assert tasks_on_node(value, node) == count


@pytest.mark.parametrize(
    "value, node, message",
    [
        ("4,2(x2)", 3, r"SLURM_NODEID=3 is beyond the 3 node\(s\) of SLURM_TASKS_PER_NODE='4,2\(x2\)'"),
        ("2(x3)", 3, "SLURM_NODEID=3 is beyond"),
        ("4,2", None, "differs between nodes, and which node this is"),
        ("4,,2", 0, "SLURM_TASKS_PER_NODE='4,,2' is not Slurm's tasks per node"),
    ],
)
def test_tasks_on_a_node_that_cannot_be_found(value, node, message):
    with pytest.raises(ValueError, match=message):
        tasks_on_node(value, node)


SLURM_FIELDS = {"rank": "SLURM_PROCID", "local_rank": "SLURM_LOCALID", "local_world_size": "SLURM_STEP_TASKS_PER_NODE",
                "world_size": "SLURM_STEP_NUM_TASKS", "node": "SLURM_NODEID"}  # fmt: skip


@pytest.mark.parametrize(
    "environ, fields, source",
    [
        ({}, (None, None, None, None, None), {}),
        (TORCHRUN_3_OF_4, (3, 1, 2, 4, 1), TORCHRUN),
        # Lightning's SLURMEnvironment under srun: Slurm's variables only
        (slurm_task(3, 1, 1, "2(x2)"), (3, 1, 2, 4, 1), SLURM_FIELDS),
        (slurm_task(5, 1, 2, "4,2(x2)"), (5, 1, 2, 8, 2), SLURM_FIELDS),
        (slurm_task(3, 3, 0, "4,2(x2)"), (3, 3, 4, 8, 0), SLURM_FIELDS),
        # torchrun inside srun (one task per node): torchrun's, although Slurm's differ
        ({**slurm_task(1, 0, 1, "1(x2)"), **TORCHRUN_3_OF_4}, (3, 1, 2, 4, 1), TORCHRUN),
    ],
)
def test_launch_view(environ, fields, source):
    view = launch_view(environ)
    assert (view.rank, view.local_rank, view.local_world_size, view.world_size, view.node) == fields
    assert dict(view.source) == source and not view.problems
    assert view.from_slurm is (source is SLURM_FIELDS)


def _only(environ: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k in names}


def test_slurm_variables_in_order():
    task = slurm_task(3, 1, 1, "2(x2)")
    # srun --preserve-env: SLURM_NTASKS and SLURM_TASKS_PER_NODE stay the job's; the step's come first
    job = {**task, "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NTASKS_PER_NODE": "8"}
    assert (launch_view(job).local_world_size, launch_view(job).world_size) == (2, 4)
    # without the step's variables: SLURM_TASKS_PER_NODE, SLURM_NTASKS
    plain = _only(task, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE")
    view = launch_view(plain)
    assert (view.local_world_size, view.world_size) == (2, 4)
    assert view.source["local_world_size"] == "SLURM_TASKS_PER_NODE" and view.source["world_size"] == "SLURM_NTASKS"
    # SLURM_NTASKS_PER_NODE only: the request, the same on every node
    view = launch_view({**_only(plain, "SLURM_PROCID", "SLURM_NTASKS"), "SLURM_NTASKS_PER_NODE": "2"})
    assert view.local_world_size == 2 and view.source["local_world_size"] == "SLURM_NTASKS_PER_NODE"
    assert view.node is None and view.local_rank is None and view.node_lead is False  # rank 3, no local id
    # an empty variable counts as not set
    assert launch_view({**plain, "SLURM_TASKS_PER_NODE": ""}).local_world_size is None


def test_torchrun_variables_that_agree_with_slurm_are_completed_by_it():
    task = slurm_task(3, 1, 1, "2(x2)")
    # MONAI's multi-node examples set RANK, LOCAL_RANK and WORLD_SIZE from Slurm's themselves, nobody LOCAL_WORLD_SIZE
    view = launch_view({**task, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert (view.local_world_size, view.node) == (2, 1)
    assert view.source["rank"] == "RANK" and view.source["local_world_size"] == "SLURM_STEP_TASKS_PER_NODE"


@pytest.mark.parametrize(
    "extra",
    [
        {"RANK": "5", "WORLD_SIZE": "8"},  # mp.spawn inside a task: ranks of its own
        {"LOCAL_RANK": "0", "WORLD_SIZE": "4"},  # Lightning's own launcher inside a 1-task step: its main process
        {"LOCAL_RANK": "3"},  # a child that the task started
        {"LOCAL_WORLD_SIZE": "4"},
    ],
)
def test_slurm_variables_that_do_not_describe_the_process_are_not_used(extra):
    view = launch_view({**slurm_task(0, 0, 0, "1"), **extra})  # a 1-task step
    assert dict(view.source) == {field: name for field, name in TORCHRUN.items() if name in extra}


def test_an_allocation_shell_is_not_a_task():
    # salloc's shell (or a login shell of the job): the job's variables, no SLURM_PROCID
    job = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2"}
    assert launch_view(job) == launch_view({})


@pytest.mark.parametrize(
    "environ, field, message",
    [
        ({"LOCAL_WORLD_SIZE": "two"}, "local_world_size", "LOCAL_WORLD_SIZE='two' is not a non-negative integer"),
        ({"RANK": "-1"}, "rank", "RANK='-1' is not"),
        ({"LOCAL_RANK": "1.0"}, "local_rank", "LOCAL_RANK='1.0' is not"),
        ({**slurm_task(0, 0, 0, "2"), "SLURM_STEP_TASKS_PER_NODE": "2(x"}, "local_world_size",
         "SLURM_STEP_TASKS_PER_NODE='2\\(x' is not Slurm's tasks per node"),
        ({**slurm_task(0, 0, 4, "2"), "SLURM_STEP_TASKS_PER_NODE": "2,1"}, "local_world_size",
         "SLURM_NODEID=4 is beyond the 2 node"),
        ({**slurm_task(0, 0, 0, "2"), "SLURM_NODEID": "zero", "SLURM_STEP_TASKS_PER_NODE": "2,1"}, "local_world_size",
         "differs between nodes, and which node this is"),
        ({**slurm_task(0, 0, 0, "2"), "SLURM_LOCALID": "x"}, "local_rank", "SLURM_LOCALID='x' is not"),
    ],
)  # fmt: skip
def test_a_value_that_cannot_be_read_leaves_its_field_unknown_and_says_why(environ, field, message):
    view = launch_view(environ)
    assert getattr(view, field) is None
    assert re.search(message, view.problems[field]), view.problems


def test_a_torchrun_variable_that_cannot_be_read_is_not_replaced_by_slurms():
    view = launch_view({**slurm_task(1, 1, 0, "2"), "LOCAL_WORLD_SIZE": "two"})
    assert view.local_world_size is None and view.source["local_world_size"] == "LOCAL_WORLD_SIZE"
    assert view.local_rank == 1 and view.source["local_rank"] == "SLURM_LOCALID"


@pytest.mark.parametrize(
    "environ, lead",
    [
        ({}, True), ({"RANK": "0"}, True), ({"RANK": "2"}, False), ({"LOCAL_RANK": "0", "RANK": "3"}, True),
        ({"LOCAL_RANK": "1"}, False), ({"LOCAL_RANK": ""}, True),
        (slurm_task(2, 0, 1, "2(x2)"), True), (slurm_task(3, 1, 1, "2(x2)"), False),
        ({**slurm_task(3, 1, 1, "2(x2)"), "LOCAL_RANK": "0", "RANK": "4", "WORLD_SIZE": "8"}, True),  # not Slurm's
    ],
)  # fmt: skip
def test_node_lead(environ, lead):
    assert launch_view(environ).node_lead is lead
