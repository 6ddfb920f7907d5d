#pragma once
#include "CUDAGeneratorImpl.h"
