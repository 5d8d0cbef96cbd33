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
