"""Lookahead: the data iterator read ahead for a teacher client's requests."""

import threading

from megatron_kd.teacher.lookahead import Lookahead


def test_next_and_ahead_see_every_item_once_in_order():
    look = Lookahead(iter(range(6)))
    ahead = look.ahead()
    assert [next(ahead), next(ahead), next(ahead)] == [0, 1, 2]  # read before training uses them
    assert next(look) == 0 and look.current == 0
    assert [next(look) for _ in range(4)] == [1, 2, 3, 4]  # 3 and 4 read by next() first...
    assert list(ahead) == [3, 4, 5]  # ... and still handed to ahead(), once, in order
    assert next(look) == 5 and look.current == 5


def test_two_threads_read_the_source_once_each_item():
    reads = []

    def source():
        for i in range(2000):
            reads.append(i)
            yield i

    look = Lookahead(source())
    got_ahead = []
    thread = threading.Thread(target=lambda: got_ahead.extend(look.ahead()))
    thread.start()
    got_next = [next(look) for _ in range(2000)]
    thread.join(timeout=30)
    assert reads == list(range(2000))
    assert got_next == list(range(2000)) and got_ahead == list(range(2000))


def test_what_the_consumer_rewrites_stays_out_of_current():
    """Megatron-LM's get_batch rewrites the batch dict it gets in place (tokens None off the
    first stage): the teacher still finds the tokens in ``current``."""
    tokens = [1, 2, 3]
    look = Lookahead(iter([{"tokens": tokens, "labels": [2, 3, 4]}]))
    batch = next(look)
    batch["tokens"] = None
    assert look.current["tokens"] is tokens and look.current["labels"] == [2, 3, 4]


def _rerun_iterator(items):
    from megatron.core.rerun_state_machine import RerunDataIterator

    return RerunDataIterator(iter(items))


def test_step_run_again_gets_its_own_items_not_the_read_ahead():
    """Megatron-Core's RerunDataIterator replays what it read during the step; read ahead, that
    is the next steps' items. Taken over, the step's own items come again, in order, while the
    sender reads on."""
    source = _rerun_iterator(range(10))
    look = Lookahead(source, replayable=True)
    ahead = look.ahead()
    source.advance()  # step 0 begins (the machine's call)
    assert [next(ahead) for _ in range(4)] == [0, 1, 2, 3]  # requests two steps ahead
    assert [next(look), next(look)] == [0, 1] and not look.replayed
    source.rewind()  # step 0 runs again
    assert next(look) == 0 and look.replayed and look.current == 0
    assert next(ahead) == 4  # the sender reads on, unaffected
    assert next(look) == 1 and look.replayed
    source.advance()  # step 1
    assert [next(look), next(look)] == [2, 3] and not look.replayed
    source.advance()  # step 2, no rerun of step 1
    assert next(look) == 4 and not look.replayed


def test_step_run_twice_again_and_a_step_begun_mid_replay_refused():
    import pytest

    source = _rerun_iterator(range(6))
    look = Lookahead(source, replayable=True)
    source.advance()
    assert [next(look), next(look)] == [0, 1]
    source.rewind()
    assert [next(look), next(look)] == [0, 1]
    source.rewind()  # the machine rewinds again before a checkpoint-and-restart
    assert next(look) == 0
    with pytest.raises(RuntimeError, match="1 item"):
        source.advance()


def test_replayable_needs_a_rerun_iterator_and_plain_keeps_nothing():
    import pytest

    with pytest.raises(TypeError, match="rewind"):
        Lookahead(iter(range(3)), replayable=True)
    look = Lookahead(iter(range(3)))
    assert [next(look) for _ in range(3)] == [0, 1, 2]
    assert look._step == [] and not look.replayed
