"""gRPC plumbing shared by Apogee's services and clients: error mapping and server lifecycle."""
