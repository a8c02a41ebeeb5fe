"""The bottom layer shared by every part: the run config, the chat token layout, the turn-budget
schedule, the environment contract, the device plan, the run directory's paths and the files two
processes share (the actors' outbox, run events, the coordinator's state, recorded episodes, AgentGym
trajectories), the registry of programs, and what every process does the same way (logging, stop
signals).

With ``protocol/`` (the messages and their transports) it is all the parts share: they import
this layer and never each other. It imports neither torch nor vllm (tests/test_dependencies.py).
"""
