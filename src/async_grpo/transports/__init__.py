"""Where roles meet: typed messages, the rollout queue, and trainer -> vLLM weight transfer."""
