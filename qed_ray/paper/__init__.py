"""The paper wing: standalone experiments beside the service (the toy MDP of the paper's Sec. 5.2 and the numerical
checks of its theory); it imports the RL wing's networks and the floor."""
