#pragma once
// sharding::parameters named in a comment is fine.
