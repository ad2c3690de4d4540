"""The operator's logic: resources read and checked, reconcilers that know the brokers through
the SDK's admin client, and the controller that feeds them from the API server."""
