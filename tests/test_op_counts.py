"""opencood.utils.op_counts: operators counted as a GPU would launch them, by op and phase."""
import torch

from opencood.utils.op_counts import OpCounter


def test_kernels_count_work_and_not_views_or_host_reads():
    x = torch.arange(6.0)
    with OpCounter() as ops:
        y = (x + 1).view(2, 3).t()      # add: a kernel; view, t: metadata only
        z = y.detach() * 2              # detach: metadata; mul: a kernel
        total = z.sum().item()          # sum: a kernel; item: a host read
    assert total == 42.0
    assert dict(ops.by_op) == {"add": 1, "mul": 1, "sum": 1}
    assert ops.kernels == 3
    assert ops.total == 7               # + view, t, detach, _local_scalar_dense


def test_a_foreach_operator_counts_once_and_backward_ops_count_too():
    weights = [torch.ones(3, requires_grad=True) for _ in range(4)]
    with OpCounter() as ops:
        with ops.phase("optimizer"):
            with torch.no_grad():
                torch._foreach_add_(weights, 1.0)
        with ops.phase("forward"):
            loss = (weights[0] * 3).sum()
        ops.set_phase("backward")
        loss.backward()
        ops.set_phase(None)
    assert ops.by_phase["optimizer"] == 1
    assert ops.by_phase["forward"] == 2                   # mul, sum
    # the seed gradient (ones_like), sum's backward (expand: a view), mul's backward (mul)
    assert ops.by_phase["backward"] == 2
    assert ops.kernels == sum(ops.by_phase.values())
    assert weights[0].grad.tolist() == [3.0, 3.0, 3.0]


def test_profiler_markers_are_no_kernels():
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    optimizer = torch.optim.SGD([weight], lr=0.5, foreach=True)
    with OpCounter() as ops:
        optimizer.step()                # inside record_function("Optimizer.step#SGD.step")
        optimizer.zero_grad()
    assert dict(ops.by_op) == {"_foreach_add_": 1}
    assert ops.total > ops.kernels      # the markers were dispatched, and not counted
    assert weight.tolist() == [0.5, 0.5]
