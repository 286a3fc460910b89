"""The loop's one batch type (RolloutBatch), below both rollout (which fills it) and the actor
and critic (which compute on it)."""
