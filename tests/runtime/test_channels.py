"""The inbox between worker processes and the streams' inline jobs: what a message carries across
processes, and that a job run on the calling thread (inline, or by a waiter helping) keeps its
stream's order, timeline and identity."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time

import pytest
import torch

from harmony.runtime.admission import on_compute_thread
from harmony.runtime.channels import Inbox, Mailbox
from harmony.runtime.streams import Stream, current_stream


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


def _held_stream(helpable: bool = True) -> tuple[Stream, threading.Event]:
    """A stream whose thread is held before it takes any job, so that what is queued stays queued."""
    gate = threading.Event()
    return Stream("swap-in", setup=lambda: gate.wait(10), helpable=helpable), gate


def test_a_waiter_runs_the_jobs_queued_ahead_of_its_own_itself_in_order_as_the_streams():
    stream, gate = _held_stream()
    seen: list[tuple[str, threading.Thread, object, bool]] = []

    def job(name: str) -> str:
        seen.append((name, threading.current_thread(), current_stream(), on_compute_thread()))
        return name

    first, mine = stream.submit(job, "first", label="first"), stream.submit(job, "mine", label="mine")
    later = stream.submit(job, "later")
    stream.help(mine)
    assert [name for name, *_ in seen] == ["first", "mine"]  # in order, and nothing behind it
    assert all(thread is threading.current_thread() and where is stream and not compute
               for _, thread, where, compute in seen)  # run here, but as the stream's jobs
    assert first.result(0) == "first" and mine.result(0) == "mine" and not later.done()
    assert current_stream() is None and on_compute_thread()
    assert [label for _, label, _, _ in stream.take_events()] == ["first", "mine"]
    gate.set()
    assert later.result(10) == "later" and not stream.busy()
    stream.close()


def test_a_waiter_leaves_a_job_the_streams_thread_has_taken_to_it_and_runs_none_behind_it():
    stream = Stream("swap-out", helpable=True)
    release, started = threading.Event(), threading.Event()
    ran_on: list[threading.Thread] = []
    running = stream.submit(lambda: (started.set(), release.wait(10), ran_on.append(threading.current_thread())))
    behind = stream.submit(lambda: ran_on.append(threading.current_thread()))
    assert started.wait(10)
    stream.help(behind)  # the job ahead runs on the stream's thread: the waiter must wait, not overtake it
    assert not behind.done() and ran_on == []
    release.set()
    behind.result(10)
    running.result(10)
    assert threading.current_thread() not in ran_on
    stream.close()


def test_a_failing_job_run_by_a_waiter_hands_its_error_to_its_future():
    stream, gate = _held_stream()
    failing = stream.submit(lambda: 1 / 0)
    stream.help(failing)
    with pytest.raises(ZeroDivisionError):
        failing.result(0)
    assert not stream.busy()
    gate.set()
    stream.close()


def test_a_stream_that_is_not_helpable_runs_its_jobs_on_its_own_thread_only():
    stream, gate = _held_stream(helpable=False)  # a GPU's: its copies belong on its CUDA stream
    ran_on: list[threading.Thread] = []
    job = stream.submit(lambda: ran_on.append(threading.current_thread()))
    stream.help(job)
    assert not job.done()
    gate.set()
    job.result(10)
    assert ran_on and ran_on[0] is not threading.current_thread()
    stream.close()
