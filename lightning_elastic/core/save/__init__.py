"""One save: request and result types, plan, stage (the blocking host copy), write, and the
pipeline that runs them and takes part in the commit."""
