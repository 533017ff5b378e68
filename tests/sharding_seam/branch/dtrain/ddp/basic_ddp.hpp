#pragma once
// A core that reads the stage itself (the check must refuse it).
