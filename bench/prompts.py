"""Benchmark prompts unlike the draft's training data (not HumanEval, not stdlib modules a-m)."""

# The draft was distilled on Python instructions (stdlib modules a-m, HumanEval): it only knows code.
# These are Python tasks on modules n-z and everyday programming, none of them in its training data.
HELD_OUT = [
    "Show how to use the Python random module to shuffle a deck of cards and deal two hands.",
    "Explain what Python's os.path module is for, with three short examples.",
    "Write a Python function that uses the re module to extract all email addresses from a text.",
    "How do I read and write JSON-like settings with the shelve module in Python?",
    "Write a Python script that uses the subprocess module to run a command and capture its output.",
    "Explain the difference between threading and multiprocessing in Python with examples.",
    "Use the statistics module to compute the mean, median and standard deviation of a list.",
    "Write a Python class for a bank account with deposit and withdraw methods and error handling.",
    "Show how to parse command-line flags with the optparse module.",
    "Write a Python function that uses the zipfile module to compress every file in a folder.",
    "How does the pathlib module make file handling easier? Give examples.",
    "Write a Python generator that yields the Fibonacci numbers below a limit.",
    "Use the sqlite3 module to create a table, insert rows and query them.",
    "Explain Python's string formatting options with the str.format method and f-strings.",
    "Write a small unit test with the unittest module for a function that reverses a string.",
    "Use the time and timeit modules to measure how long sorting a million numbers takes.",
]


def chat_ids(tokenizer, prompts):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for p in prompts]
