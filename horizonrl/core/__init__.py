"""The bottom layer shared by every part: the run config, the chat token layout, the turn-budget
schedule, the environment contract, run directories, the AgentGym trajectory file format and
what every process does the same way (logging, stop signals).

With ``protocol/`` (the messages and their transports) it is all the parts share: they import
this layer and never each other. It imports neither torch nor vllm (tests/test_dependencies.py).
"""
