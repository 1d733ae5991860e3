"""Inside each Ray worker actor: the actor itself, its membership in elastic epochs, and the
job-private rendezvous store. The collective engine it starts lives in :mod:`hvdray.collective`."""
