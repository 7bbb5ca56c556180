"""The rank process: start-up, the rank loop, the broadcast to TP peers, liveness, and the messages the
engine and the ranks exchange (messages.py is shared by engine/ and worker/)."""
