from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.parallel.schedules import (PipeShape, Task, check_order, format_orders, gpipe_order,
                                   interleaved_order, one_f_one_b_order)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), v=st.integers(1, 4), groups=st.integers(1, 4), extra=st.integers(0, 3))
def test_every_order_runs_each_task_once_backward_after_forward(p: int, v: int, groups: int,
                                                                extra: int) -> None:
    m = p * groups + extra
    shape = PipeShape(pp=p, vpp=v, microbatches=m)
    for r in range(p):
        check_order(interleaved_order(r, shape), shape)
        check_order(interleaved_order(r, shape, m), shape)
        flat = PipeShape(pp=p, vpp=1, microbatches=m)
        check_order(gpipe_order(r, flat), flat)
        check_order(one_f_one_b_order(r, flat), flat)


def test_1f1b_warmup_depends_on_stage() -> None:
    shape = PipeShape(pp=4, vpp=1, microbatches=6)
    first_backward = [next(i for i, t in enumerate(one_f_one_b_order(r, shape)) if t.phase == "B")
                      for r in range(4)]
    assert first_backward == [4, 3, 2, 1]  # warm-up of p - r - 1 forwards, then one more


def test_tasks_print_and_parse() -> None:
    shape = PipeShape(pp=2, vpp=2, microbatches=4)
    orders = {r: interleaved_order(r, shape) for r in range(2)}
    text = format_orders(orders)
    line0 = text.splitlines()[0].split(": ")[1].split()
    assert [Task.parse(t) for t in line0] == orders[0]
