"""The inbox between worker processes and the streams' inline jobs: what a message carries across
processes, and that a job run on the calling thread keeps its stream's order and timeline."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time

import pytest
import torch

from harmony.runtime.channels import Inbox, Mailbox
from harmony.runtime.streams import Stream


def _send_from_a_child(inbox: Inbox, received) -> None:
    inbox.put((("X", 3), ("items", torch.arange(4.0).share_memory_(), 1)))
    received.wait(10)  # the sender hands the tensor's memory over while it lives, as a worker does


def test_an_inbox_carries_a_message_from_another_process_tensor_and_all():
    context = multiprocessing.get_context("fork")
    inbox, received = Inbox(context), context.Event()
    child = context.Process(target=_send_from_a_child, args=(inbox, received))
    child.start()
    key, (kind, tensor, rank) = inbox.get(timeout=10)
    received.set()
    child.join(timeout=10)
    assert key == ("X", 3) and kind == "items" and rank == 1
    assert torch.equal(tensor, torch.arange(4.0))
    inbox.close()


def test_an_empty_inbox_says_so_after_its_timeout_instead_of_blocking():
    inbox = Inbox(multiprocessing.get_context("fork"))
    began = time.monotonic()
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.05)
    assert time.monotonic() - began < 5
    inbox.close()


def test_a_mailbox_hands_over_by_key_what_its_inbox_received_in_any_order():
    inbox = Inbox(multiprocessing.get_context("fork"))
    mailbox = Mailbox(inbox, aborted=lambda: False)
    inbox.put(("second", 2))
    inbox.put(("first", 1))
    assert mailbox.take("first", "the first message", timeout=10) == 1
    assert mailbox.take("second", "the second message", timeout=10) == 2
    mailbox.close()
    inbox.close()


def test_an_idle_stream_runs_a_job_on_the_calling_thread_and_times_it():
    stream = Stream("p2p-out")
    ran_on: list[threading.Thread] = []
    stream.run_here(lambda: ran_on.append(threading.current_thread()), label="Y to dev1", task=7)
    assert ran_on == [threading.current_thread()]
    [(task, label, start, end)] = stream.take_events()
    assert (task, label) == (7, "Y to dev1") and start <= end
    stream.close()


def test_a_busy_stream_queues_an_inline_job_behind_its_work_in_order():
    stream = Stream("p2p-out")
    release = threading.Event()
    order: list[str] = []
    stream.submit(lambda: (release.wait(10), order.append("queued first")), label="first")
    stream.run_here(lambda: order.append("inline second"), label="second")
    assert order == []  # not run ahead of the job in front of it
    release.set()
    deadline = time.monotonic() + 10
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["queued first", "inline second"]
    stream.close()
