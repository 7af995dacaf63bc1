"""``nn.DataParallel`` on the virtual GPU, in this process: on one card it runs its module on
the batch as a card does, and across several devices it is refused in one line.

The bytes are the tensors' sizes in the caching allocator's 512-byte blocks.
"""

from __future__ import annotations

import pytest
import torch
from test_run_cli import F32, block
from torch import nn
from torch.nn.parallel import comm

from memprof.collect.virtual.gpu import VirtualGpu
from memprof.collect.virtual.unsupported import VirtualGpuUnsupported

IN, OUT, BATCH = 64, 32, 16


LINEAR = block(IN * OUT * F32) + block(OUT * F32)



def test_data_parallel_on_one_card_runs_its_module_on_the_batch(gpu: VirtualGpu) -> None:
    model = nn.DataParallel(nn.Linear(IN, OUT))  # moved to the card: there is one
    assert model.device_ids == [0] and model.module.weight.is_cuda
    assert torch.cuda.memory_allocated() == LINEAR
    x = torch.ones(BATCH, IN, device="cuda")
    model(x)  # the first matmul's cuBLAS workspace, held from then on
    before = torch.cuda.memory_allocated()
    y = model(x)  # scattered to the one card: a view of the batch, no copy
    assert y.is_cuda and y.shape == (BATCH, OUT)
    assert torch.cuda.memory_allocated() - before == block(BATCH * OUT * F32)
    y.sum().backward()
    assert [p.grad.shape for p in model.parameters()] == [(OUT, IN), (OUT,)]
    del y
    before = torch.cuda.memory_allocated()
    y = model(torch.ones(BATCH, IN))  # a host batch is copied to the card (autograd keeps it)
    assert y.is_cuda and torch.cuda.memory_allocated() - before == block(
        BATCH * IN * F32) + block(BATCH * OUT * F32)


def test_torch_nn_parallel_comm_on_one_card(gpu: VirtualGpu) -> None:
    a, b = torch.ones(BATCH, IN, device="cuda"), torch.ones(2, IN, device="cuda")
    before = torch.cuda.memory_allocated()
    (chunk,) = comm.scatter(a, [0])
    assert chunk.shape == a.shape and chunk._base is a  # a view, as comm.cpp's
    assert torch.cuda.memory_allocated() == before
    gathered = comm.gather([a, b], dim=0, destination=0)  # a new tensor
    assert gathered.is_cuda and gathered.shape == (BATCH + 2, IN)
    assert torch.cuda.memory_allocated() - before == block((BATCH + 2) * IN * F32)
    assert comm.broadcast_coalesced([a, b], [0]) == [[a, b]]
    a.record_stream(torch.cuda.current_stream())  # the card's streams have no work pending


def test_data_parallel_across_devices_is_refused_in_one_line(gpu: VirtualGpu) -> None:
    model = nn.DataParallel(nn.Linear(IN, OUT).cuda(), device_ids=[0, 1])
    with pytest.raises(VirtualGpuUnsupported) as refused:
        model(torch.ones(BATCH, IN, device="cuda"))
    assert str(refused.value) == (
        "memprof's virtual GPU cannot run nn.DataParallel (torch.nn.parallel's scatter, gather"
        " and broadcast) across cuda:0, cuda:1 (the virtual GPU is one card, cuda:0); leave"
        " DataParallel its default device_ids, [0], or run memprof on a machine with the GPUs")


def test_recurrent_layers_say_the_card_has_no_cudnn(gpu: VirtualGpu, capsys) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not PyTorch's "compiled without cuDNN" warning
        lstm = nn.LSTM(IN, OUT, batch_first=True).cuda()
        out, _ = lstm(torch.ones(BATCH, 5, IN, device="cuda"))
    assert out.shape == (BATCH, 5, OUT) and out.is_cuda
    assert "no cuDNN behind the card: recurrent layers (nn.LSTM, nn.GRU, nn.RNN) run" \
        " PyTorch's own kernels" in capsys.readouterr().err


def test_a_tensor_put_on_another_card_is_said_to_be_predicted_on_this_one(
        gpu: VirtualGpu, capsys) -> None:
    """Model parallelism by hand, or a rank's tensors on cuda:0: one card a process."""
    x = torch.ones(BATCH, IN).to("cuda:1")
    assert x.is_cuda and torch.cuda.memory_allocated() == block(BATCH * IN * F32)
    assert "the script puts CUDA tensors on cuda:1, and this process's card is cuda:0: they" \
        " are predicted on cuda:0" in capsys.readouterr().err
