"""What every request of the web process passes through, whichever app
answers it: the operator API's JSON parsing, its errors and their place in
the OpenAPI schema, and the site-wide middleware. Settings name these by
dotted path; the apps never import them."""
