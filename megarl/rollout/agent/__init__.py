"""Multi-turn, tool-using rollouts (`generation.producer=agent`): the agent loop (a SampleProducer),
the tools it may call and the worker processes that run them, parsing tool calls out of a turn, and
the chat template's tokens inserted between turns."""
