"""Stop strings across token boundaries, hold-back, include_stop_str_in_output."""

from llm_engine.stopping import StopChecker


def run(stop, pieces, include=False):
    sc = StopChecker(stop, [], [], False, include)
    out, matched = "", False
    for p in pieces:
        text, matched = sc.feed(p)
        out += text
        if matched:
            return out, True
    return out + sc.flush(), False


def test_match_spanning_tokens():
    assert run(["STOP"], ["abc S", "TO", "P tail"]) == ("abc ", True)


def test_include_stop_string():
    assert run(["STOP"], ["abc S", "TO", "P tail"], include=True) == ("abc STOP", True)


def test_never_emits_partial_stop_prefix():
    sc = StopChecker(["<end>"], [], [], False, False)
    assert sc.feed("hello <e") == ("hello ", False)
    assert sc.feed("nd") == ("", False)
    assert sc.feed(">") == ("", True)


def test_partial_that_does_not_match_is_released():
    sc = StopChecker(["<end>"], [], [], False, False)
    assert sc.feed("a <e") == ("a ", False)
    assert sc.feed("x") == ("<ex", False)


def test_earliest_of_several_stops_wins():
    assert run(["world", "lo"], ["hello world"]) == ("hel", True)


def test_literal_matching_no_regex():
    assert run([".*", "(a|b)+"], ["xyz (a|b)+ ..."]) == ("xyz ", True)


def test_stop_tokens_and_eos():
    sc = StopChecker([], [7], [2], ignore_eos=False, include_stop_str_in_output=False)
    assert sc.is_stop_token(7) and sc.is_stop_token(2) and not sc.is_stop_token(3)
    assert not StopChecker([], [], [2], ignore_eos=True, include_stop_str_in_output=False).is_stop_token(2)


def test_no_stops_passes_through():
    sc = StopChecker([], [], [], False, False)
    assert sc.feed("abc") == ("abc", False)


def test_released_text_is_split_back_into_its_steps():
    from llm_engine.outputs import split_text

    assert split_text("abcdef", [2, 0, 3, 1]) == ["ab", "", "cde", "f"]
    assert split_text("abc", [2, 3, 1]) == ["ab", "c", ""]  # cut by a stop string
    assert split_text("abcdé", [2, 2]) == ["ab", "cdé"]  # the end flushed an unfinished character


class ReferenceChecker:
    """The plain algorithm: every stop string searched in the whole buffer at each feed."""

    def __init__(self, stop, include):
        self.stop, self.include, self.buffer = [s for s in stop if s], include, ""

    def feed(self, text):
        self.buffer += text
        found = [(self.buffer.find(s), i, s) for i, s in enumerate(self.stop) if s in self.buffer]
        if found:
            pos, _, s = min(found)
            out, self.buffer = self.buffer[:pos + len(s) if self.include else pos], ""
            return out, True
        hold = 0
        for s in self.stop:
            cap = min(len(s) - 1, len(self.buffer))
            hold = max([hold] + [n for n in range(1, cap + 1) if self.buffer.endswith(s[:n])])
        cut = len(self.buffer) - hold
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False


def test_indexed_matching_agrees_with_searching_every_string():
    import random

    rng = random.Random(7)
    alphabet = "ab c"
    for _ in range(3000):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.2:  # long ones: their prefixes are not indexed but scanned
            stop.append("".join(rng.choice(alphabet) for _ in range(rng.randint(65, 80))))
        if rng.random() < 0.1:
            stop.append("ab" * 40)
        include = rng.random() < 0.5
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(12)]
        fast, slow = StopChecker(stop, [], [], False, include), ReferenceChecker(stop, include)
        for piece in pieces:
            got, want = fast.feed(piece), slow.feed(piece)
            assert got == want, (stop, include, pieces)
            if got[1]:
                break
        else:
            assert fast.buffer == slow.buffer


def test_thousands_of_stop_strings():
    """The API bounds only their total length (32768 characters), not their number."""
    stop = [f"<{i:04d}>" for i in range(4681)]  # 7 characters each: 32767 in all
    assert sum(map(len, stop)) <= 32768
    sc = StopChecker(stop, [], [], False, False)
    assert sc.feed("text <12") == ("text ", False)  # "<12" may begin "<1234>"
    assert sc.feed("3") == ("", False)
    assert sc.feed("4> more") == ("", True)
    assert run(stop, ["a <99999> b"]) == ("a <99999> b", False)
    assert run(stop, ["x<4680>y"], include=True) == ("x<4680>", True)


def test_a_long_stop_string_holds_back_only_what_could_begin_it():
    """Stop strings over 64 characters once held back len-1 characters outright, so a stream
    that had one showed nothing until its end."""
    long = "The end of this story is near, and nothing will ever be the same again."
    assert len(long) > 64
    sc = StopChecker([long], [], [], False, False)
    assert sc.feed("Once upon a time") == ("Once upon a time", False)
    assert sc.feed(" there was The end") == (" there was ", False)
    assert sc.feed(" of it all") == ("The end of it all", False)
    assert sc.feed(" " + long[:40]) == (" ", False)
    assert sc.feed(long[40:] + " tail") == ("", True)
