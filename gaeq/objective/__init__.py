"""What the weights every target got in the update say a run optimises (no torch): each step's shape
(`shapes`), a run's weighting (`weighting`), and two runs' weights row by row (`invariance`) — read by
gaeq.script.targets inside a rank, judged by gaeq.results.weighing."""
