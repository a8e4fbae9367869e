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
