"""The core of the domain: block schemas and values, formats, profiles, ids, errors, limits."""
